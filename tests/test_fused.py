"""The round's fused bookkeeping (speculative/batch_tree.py `fused`: torch.compile on CUDA) against its plain
reference, compiled here on the CPU (Inductor's C++ backend: the same graphs, another code generator) on random
inputs, and a whole generate with it equal to the unfused one."""
import pytest
import torch

from trtllm_microspec.speculative import batch_tree as BT
from trtllm_microspec.speculative.tree import TreeConfig


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    monkeypatch.setattr(BT, "FUSE_DEVICES", {"cpu"})
    monkeypatch.setattr(BT, "_COMPILE", True)


def random_round(B: int, cfg: TreeConfig, d: int = 16, vocab: int = 500, seed: int = 0):
    """A draft round's bookkeeping on random head outputs, every call made through `call(fn, *args)`."""
    g = torch.Generator().manual_seed(seed)
    k, c = cfg.top_k, BT._constants(cfg, torch.device("cpu"))

    def head():
        logp = torch.rand(B, k, k, generator=g).log().sort(dim=2, descending=True).values
        return logp, torch.randint(0, vocab, (B, k, k), generator=g)

    def run(call):
        logp, ids = head()
        pool_tok, pool_score, bests = [ids[:, 0]], [logp[:, 0]], []
        cur_score = logp[:, 0]
        anc = c["anc0"].expand(B, -1, -1).contiguous()
        grown = []
        for i in range(cfg.depth):
            logp, ids = head()
            h = torch.randn(B, k, d, generator=g)
            if i + 1 == cfg.depth:
                pool_tok.append(ids.flatten(1))
                pool_score.append((cur_score[:, :, None] + logp).flatten(1))
                break
            out = call(BT._grow, cur_score, logp, ids, h, anc, c["step_eye"][i])
            score, best, _, cur_score, _, anc = out
            grown.append(out)
            pool_tok.append(ids.flatten(1))
            pool_score.append(score)
            bests.append(best)
        root = torch.randint(0, vocab, (B,), generator=g)
        tree = call(BT._tree, root, pool_tok, pool_score, bests, cfg, c)
        # the target's draws: at each node one of its children's tokens (so a path is accepted), or noise
        argmax = torch.randint(0, vocab, (B, cfg.total_tokens), generator=g)
        argmax.scatter_(1, tree[1][:, 1:], tree[0][:, 1:])
        argmax = torch.where(torch.rand(B, cfg.total_tokens, generator=g) < 0.8, argmax, vocab)
        acc = call(BT._accept, *tree, argmax, torch.arange(cfg.max_path))
        return grown, tree, acc

    return run


@pytest.mark.parametrize("B,cfg", [(1, TreeConfig(5, 10, 60)), (3, TreeConfig(3, 4, 12)), (2, TreeConfig(1, 4, 5))])
def test_fused_matches_plain(compiled_on_cpu, B, cfg):
    plain = random_round(B, cfg)(lambda fn, *a: fn.plain(*a))
    fused = random_round(B, cfg)(lambda fn, *a: fn(*a))
    for p, f in zip(torch.utils._pytree.tree_leaves(plain), torch.utils._pytree.tree_leaves(fused)):
        assert p.dtype == f.dtype and p.shape == f.shape
        assert torch.equal(p, f)
    tokens, parent, depth, anc = plain[1]
    # the selection kept each node's parent, and the acceptance walked some path (the test's draws accept often)
    assert (parent[:, 1:] < torch.arange(1, cfg.total_tokens)).all() and (depth[:, 1:] > 0).all()
    assert plain[2][1].max() > 0


def test_fused_generate_is_the_plain_one(compiled_on_cpu):
    from trtllm_microspec.llm import LLM

    llm = LLM("smollm2-135m", "microspec", device="cpu", dtype="float32", spec_policy="fixed",
              depth=3, top_k=4, total_tokens=12)
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    got = llm.generate(prompt, 24)
    BT.FUSE_DEVICES.clear()  # the fixture's set: the same engine now runs the plain functions
    ref = llm.generate(prompt, 24)
    assert got.token_ids == ref.token_ids and len(got.token_ids) == 24
    assert got.stats["rounds"] > 0 and got.stats["acceptance_length"] == ref.stats["acceptance_length"]
