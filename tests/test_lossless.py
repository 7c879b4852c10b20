"""Greedy speculative decoding is lossless: every method emits exactly `LLM(engine, "ar")`'s tokens, alone (a batch
of one in the batched engine), every step a round of the configured tree (spec_policy fixed; test_policy.py
checks every tree the auto policy may pick).

Two drafts: the random EAGLE head (the real draft code path; it almost never gets a token accepted) and the
target itself behind its own KV cache, fed token t+1 at position t like an EAGLE head. The latter predicts the
target well, so rounds accept several tokens and the multi-token paths (KV compaction, window appends of
long accepted paths, eviction within one append under a small W_max) are exercised too."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from trtllm_microspec import LLM
from trtllm_microspec.llm import FREQ_FILE, resolve_engine
from trtllm_microspec.models.model import ModelConfig
from trtllm_microspec.models.tokenizer import Tokenizer
from trtllm_microspec.speculative.eagle import EagleDraft, draft_config, save_draft

METHODS = ["eagle", "frspec", "microspec", "microspec-paper", "ctx-only", "ext-only", "naive"]
WINDOW_METHODS = {"microspec", "microspec-paper", "ctx-only", "ext-only", "naive"}
# (prompt, chat, max_new_tokens); the first stops at EOS after 8 tokens
CASES = [
    ("What is the capital of France?", True, 32),
    ("def fibonacci(n):", False, 32),
    ("Hi", True, 1),
]
SMALL = dict(depth=2, top_k=4, total_tokens=10, w_max=16, k_pre=2, k_ver=2, static_k=300)  # W_max < one append
STATS_KEYS = {"method", "prompt_tokens", "new_tokens", "rounds", "acceptance_length", "vocab_mean", "vocab_max",
              "coverage", "wall_s", "tokens_per_s", "stop_reason", "prefill_s", "draft_s", "verify_s", "update_s"}


@pytest.fixture(scope="module")
def engine(engine_dir, tmp_path_factory):
    """A copy of the shared engine (files linked) with a synthetic FR-Spec ranking: the ids of some chat-like
    text first, then the rest of the vocabulary in id order."""
    out = tmp_path_factory.mktemp("engine")
    for f in engine_dir.iterdir():
        if f.is_file():
            (out / f.name).symlink_to(f)
    tok = Tokenizer(engine_dir)
    text = " ".join(p for p, _, _ in CASES) + " The capital is Paris. The sea is blue and wide. return n if n < 2"
    seen = list(dict.fromkeys(tok.encode(text)))
    V = tok.fast.get_vocab_size()
    ranked = seen + [i for i in range(V) if i not in set(seen)]
    save_file({"ranked_ids": torch.tensor(ranked)}, out / FREQ_FILE)
    return out


@pytest.fixture(scope="module")
def ar(engine):
    llm = LLM(engine, "ar", device="cpu")
    out = {c: llm.generate(c[0], c[2], chat=c[1]) for c in CASES}
    eos = llm.target.cfg.eos_ids
    r = out[CASES[0]]  # the early-EOS case really stops at EOS, and EOS is its last token
    assert r.stats["stop_reason"] == "eos" and r.token_ids[-1] in eos and len(r.token_ids) < CASES[0][2]
    assert all(t not in eos for t in r.token_ids[:-1])
    r = out[CASES[1]]
    assert r.stats["stop_reason"] == "max_tokens" and len(r.token_ids) == CASES[1][2]
    assert out[CASES[-1]].num_new_tokens == 1
    return out


class SelfDraft:
    """The target (same weights) in the draft's seat, through the draft interface the engine calls: `cfg` (the
    shapes of its KV pool, which the engine allocates), `hidden(..., cache=)`, `features` and `head_in`."""

    def __init__(self, target):
        self.model, self.cfg = target, target.cfg

    def hidden(self, tokens, features, positions, slots, span, cache):
        return self.model(tokens, positions, slots, span, cache=cache)

    def features(self, h):  # the rest of a draft head's interface (speculative/eagle.py): the target's hidden as it is
        return h

    def head_in(self, h):
        return h


def self_drafted(llm):
    """llm with the self-draft: its engine is made again around it."""
    llm.draft, llm._scheduler = SelfDraft(llm.target), None
    return llm


def check(llm, method, knobs, case, got, want):
    assert got.token_ids == want.token_ids, f"{method} {knobs} differs from AR on {case}"
    assert got.text == want.text
    s = got.stats
    assert STATS_KEYS <= s.keys()
    assert s["method"] == method and s["new_tokens"] == len(got.token_ids)
    assert s["stop_reason"] == want.stats["stop_reason"]
    if len(got.token_ids) == 1:
        assert s["rounds"] == 0
        return
    assert s["rounds"] > 0 and s["acceptance_length"] >= 1
    assert 0 <= s["coverage"] <= 1
    assert s["vocab_max"] >= s["vocab_mean"] > 0
    if method in WINDOW_METHODS:  # the pinned EOS ids within the budget
        assert s["vocab_max"] <= knobs.get("w_max", 3072)
        if method == "microspec":  # filled: every round's vocabulary is the whole budget
            assert s["vocab_mean"] == s["vocab_max"] == knobs.get("w_max", 3072)
    elif method == "frspec":
        assert s["vocab_max"] == knobs.get("static_k", 32768)
    else:
        assert s["vocab_max"] == llm.target.cfg.vocab_size and s["coverage"] == 1


def generate_all(llm, method, knobs, ar, cases=CASES) -> list[float]:
    """Every case equals AR; returns each case's acceptance length."""
    out = []
    for case in cases:
        r = llm.generate(case[0], case[2], chat=case[1])
        check(llm, method, knobs, case, r, ar[case])
        out.append(r.stats["acceptance_length"])
    return out


@pytest.mark.parametrize("method", METHODS)
def test_lossless_small_tree(method, engine, random_draft_dir, ar):
    """Depth 2, top_k 4, 10 tree tokens, W_max 16: with the random head, then with the self-draft (several
    tokens accepted per round, so one append can exceed the window)."""
    llm = LLM(engine, method, draft=random_draft_dir, device="cpu", spec_policy="fixed", **SMALL)
    generate_all(llm, method, SMALL, ar)
    accepted = generate_all(self_drafted(llm), method, SMALL, ar, CASES[:2])
    assert max(accepted) > 1.3, accepted  # multi-token paths were accepted, so those were checked


@pytest.mark.parametrize("method", ["eagle", "microspec"])
def test_lossless_default_tree(method, engine, random_draft_dir, ar):
    """The default knobs (depth 5, top_k 10, 60 tree tokens, W_max 3072) with the self-draft."""
    llm = self_drafted(LLM(engine, method, draft=random_draft_dir, device="cpu", spec_policy="fixed"))
    accepted = generate_all(llm, method, {}, ar, CASES[:2])
    assert max(accepted) > 2, accepted



def test_lossless_gemma_sliding_window(tmp_path):
    """Gemma-3 (sliding layers, 262k vocabulary) with its window shrunk to 4, so every round crosses it: tree
    verification and KV compaction must keep each slot's position right for the window masks."""
    engine = resolve_engine("gemma-3-270m")
    save_draft(EagleDraft(draft_config(ModelConfig.load(engine / "config.json")), bias=False), tmp_path, engine)
    prompt, n = "The three largest cities of France are", 24
    ar = LLM(engine, "ar", device="cpu")
    ar.target.cfg.sliding_window = 4
    want = ar.generate(prompt, n)
    assert want.num_new_tokens == n
    llm = LLM(engine, "microspec", draft=tmp_path, device="cpu", spec_policy="fixed", **SMALL)
    llm.target.cfg.sliding_window = 4  # the self-draft shares this config
    got = self_drafted(llm).generate(prompt, n)
    check(llm, "microspec", SMALL, prompt, got, want)
    assert got.stats["acceptance_length"] > 1.3
