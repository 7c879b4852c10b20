"""Issue 37, `k_tree`: the target's top-K ids at every tree node it verified, the rejected ones too, join the
MicroSpec window each round (engine/spec_runner.py `_round`). A rejected node is the accepted prefix with another guess
at some depth, so its top ids are mostly what follows the bonus token: the content word the next round must draft,
which the accepted path's top-K_ver (the position before it) does not name. The window still never exceeds W_max,
and the output stays AR's."""
from __future__ import annotations

import pytest
import torch

from trtllm_microspec import LLM
from trtllm_microspec.engine import spec_runner as runner_mod

PROMPT = "Translate into French: The weather is lovely today and we are going to the beach."
TREE = dict(depth=2, top_k=3, total_tokens=8, spec_policy="fixed")


def tree_ids_in_window(monkeypatch, llm, k: int) -> list[torch.Tensor]:
    """Generate greedily; after every round's window update, whether each of the target's top-k ids at each of the
    round's tree nodes is in its request's window ([B, N * k] bool per round)."""
    runner = llm.scheduler().runner
    verified, out = [], []
    real_verify = runner_mod.verify

    def verify(*a, **kw):
        hid, logits = real_verify(*a, **kw)
        verified.append(logits)
        return hid, logits

    vocab = runner.vocab
    real_update = vocab.update

    def update(batch, tree_ids, ver_ids):
        real_update(batch, tree_ids, ver_ids)
        logits = verified[-1]
        out.append(vocab.contains(batch, logits.topk(k, -1).indices.flatten(1)))

    monkeypatch.setattr(runner_mod, "verify", verify)
    monkeypatch.setattr(vocab, "update", update)
    llm.generate(PROMPT, 12, chat=True)
    return out


@pytest.fixture(scope="module")
def ar(engine_dir):
    return LLM(engine_dir, "ar", device="cpu").generate(PROMPT, 12, chat=True).token_ids


def test_tree_nodes_top_k_enter_the_window(engine_dir, random_draft_dir, monkeypatch, ar):
    """The paper's window (no fill: membership is the stream's alone): with k_tree 2 every id the target ranked
    top-2 at any verified node, rejected or not, is in the window after the round; without it (k_tree 0, the
    window before issue 37) some are not, so the check has teeth. Both equal AR."""
    k = 2
    got = {}
    for k_tree in (0, k):
        llm = LLM(engine_dir, "microspec-paper", draft=random_draft_dir, device="cpu", k_tree=k_tree, **TREE)
        rounds = tree_ids_in_window(monkeypatch, llm, k)
        assert rounds, "no round ran"
        got[k_tree] = torch.cat([r.flatten() for r in rounds])
        monkeypatch.undo()
        assert llm.generate(PROMPT, 12, chat=True).token_ids == ar
    assert got[k].all(), f"{int((~got[k]).sum())} of the tree nodes' top-{k} ids are not in the window"
    assert not got[0].all()


def test_k_tree_keeps_w_max_and_is_lossless(engine_dir, random_draft_dir, ar):
    """A W_max far below one round's ids (8 nodes x 4 + the path's): the filled window stays at W_max ids, the
    pinned EOS within, and the output is AR's."""
    llm = LLM(engine_dir, "microspec", draft=random_draft_dir, device="cpu", k_tree=4, w_max=16, k_pre=2, k_ver=2,
              **TREE)
    r = llm.generate(PROMPT, 12, chat=True)
    assert r.token_ids == ar
    assert r.stats["rounds"] > 0 and r.stats["vocab_max"] <= 16 and r.stats["vocab_mean"] == 16


def test_k_tree_range_is_checked(engine_dir, random_draft_dir):
    from trtllm_microspec.models.registry import UserError

    with pytest.raises(UserError, match="k_tree"):
        LLM(engine_dir, "microspec", draft=random_draft_dir, device="cpu", k_tree=-1, **TREE)


def test_k_tree_default_is_microspecs_only():
    """microspec takes the measured default; microspec-paper and the ablations stay the paper's window (0); a
    k_tree given is taken as given."""
    from trtllm_microspec.llm import DEFAULT_K_TREE, k_tree_for

    assert DEFAULT_K_TREE > 0 and k_tree_for("microspec", None) == DEFAULT_K_TREE
    assert all(k_tree_for(m, None) == 0 for m in ("microspec-paper", "ctx-only", "ext-only", "naive", "eagle"))
    assert k_tree_for("microspec-paper", 2) == 2 and k_tree_for("microspec", 0) == 0


def test_one_top_k_serves_path_and_nodes(engine_dir, random_draft_dir, monkeypatch):
    """With k_tree the round takes one top-K over every node's logits: the ids it hands the window are each path
    node's top-k_ver (a block of them is some node's top-3, largest first) and every node's top-k_tree after them."""
    llm = LLM(engine_dir, "microspec-paper", draft=random_draft_dir, device="cpu", k_tree=2, k_ver=3, **TREE)
    runner = llm.scheduler().runner
    seen, logits_of = [], []
    real_verify, real_update = runner_mod.verify, runner.vocab.update

    def verify(*a, **kw):
        hid, logits = real_verify(*a, **kw)
        logits_of.append(logits)
        return hid, logits

    def update(batch, tree_ids, ver_ids):
        seen.append((logits_of[-1], ver_ids.clone()))
        real_update(batch, tree_ids, ver_ids)

    monkeypatch.setattr(runner_mod, "verify", verify)
    monkeypatch.setattr(runner.vocab, "update", update)
    llm.generate(PROMPT, 12, chat=True)
    assert seen
    for logits, ver in seen:
        N = logits.shape[1]
        top3 = logits[0].topk(3, -1).indices  # [N, 3]
        assert torch.equal(ver[0, -N * 2:], logits[0].topk(2, -1).indices.flatten())
        blocks = ver[0, :-N * 2].view(-1, 3)
        blocks = blocks[blocks[:, 0] >= 0]
        assert len(blocks) >= 1 and all((top3 == b).all(1).any() for b in blocks)
