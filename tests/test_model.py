"""Our Transformer against transformers' on the same dense weights (CPU, fp32), and the cache properties the
engine relies on: prefill == token-by-token decode, and one tree-masked pass == decoding each branch.

transformers is only the reference here. Gemma-3 runs with its sliding window shrunk to 16 on both sides, so
the 64-token prompt crosses the window and the sliding layers' masking is really compared."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trtllm_microspec.engine.loader import load_target
from trtllm_microspec.llm import resolve_engine
from trtllm_microspec.models.model import Span
from trtllm_microspec.models.registry import gguf_path

TEXT = ("In 1905 Albert Einstein, then a clerk at the patent office in Bern, published four papers that changed "
        "physics: on the photoelectric effect, on Brownian motion, on special relativity, and on the equivalence "
        "of mass and energy. Historians call it his miracle year. The papers were read slowly at first, but within "
        "a decade the ideas in them had reshaped how scientists thought about light, atoms, space and time.")
L = 64
WINDOW = 16  # Gemma-3's sliding window in these tests (the real one, 512, is longer than the prompt)

MODELS = [
    "smollm2-135m",
    "gemma-3-270m",
    # 491 MB to download and ~2 min to build: too slow for CI, run where it is cached already
    pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.skipif(
        not gguf_path("qwen2.5-coder-0.5b").exists(), reason="qwen2.5-coder-0.5b not cached (microspec models fetch)")),
]


def hf_reference(engine: Path, sliding_window: int | None):
    """transformers' model of the engine's architecture holding the engine's weights, upcast to fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    hf = dict(json.loads((engine / "source.json").read_text())["hf_config"])
    if sliding_window:
        hf["sliding_window"] = sliding_window
    cfg = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with no_init_weights():
        ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    sd = {(k if k.startswith("lm_head.") else "model." + k): v.float()
          for k, v in load_file(engine / "model.safetensors").items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref.tie_weights()
    return ref.eval()


class Ours:
    def __init__(self, engine: Path, sliding_window: int | None):
        self.model, self.tok = load_target(engine, torch.device("cpu"), torch.float32)
        if sliding_window:
            self.model.cfg.sliding_window = sliding_window

    def __call__(self, tokens, positions, slots, span):
        return self.model.logits(self.model(tokens, positions, slots, span))

    def prefill(self, ids):
        pos = torch.arange(len(ids))
        return self(ids, pos, pos, Span(torch.tensor(0), pos[None, :] <= pos[:, None], len(ids)))

    def decode_path(self, ids, n):
        """Feed ids one at a time after n cached tokens; the logits of each step."""
        out = []
        for i, t in enumerate(ids.tolist()):
            p = torch.tensor([n + i])
            out.append(self(torch.tensor([t]), p, p, Span(torch.tensor(n + i), torch.ones(1, 1, dtype=torch.bool),
                                                          n + i + 1)))
        return torch.cat(out)


@pytest.fixture(scope="module", params=MODELS)
def case(request):
    key = request.param
    engine = resolve_engine(key)
    window = WINDOW if key.startswith("gemma") else None
    ours = Ours(engine, window)
    ids = torch.tensor(ours.tok.encode(TEXT)[:L])
    assert len(ids) == L
    with torch.no_grad():
        ref_logits = hf_reference(engine, window)(ids[None]).logits[0]
        yield key, ours, ids, ref_logits


def test_logits_match_transformers(case):
    key, ours, ids, ref = case
    with torch.no_grad():
        got = ours.prefill(ids)
    assert got.shape == ref.shape
    assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"{key}: argmax differs from transformers"
    diff = (got - ref).abs().max().item()
    assert diff < 5e-3, f"{key}: max |logit difference| {diff} (logits up to {ref.abs().max().item():.1f})"


def test_gemma_window_is_exercised(case):
    """The sliding window must change the result, or the comparison above proves nothing about it."""
    key, ours, ids, _ = case
    if not key.startswith("gemma"):
        pytest.skip("no sliding layers")
    with torch.no_grad():
        small = ours.prefill(ids)
        ours.model.cfg.sliding_window = 4096
        try:
            wide = ours.prefill(ids)
        finally:
            ours.model.cfg.sliding_window = WINDOW
    assert torch.allclose(small[:WINDOW], wide[:WINDOW], atol=1e-4)  # the window bites only after it fills
    assert (small[WINDOW:] - wide[WINDOW:]).abs().max() > 1e-1


def test_decode_matches_prefill(case):
    """Prefill half the prompt, decode the rest one token at a time: same logits as prefilling it all."""
    key, ours, ids, _ = case
    h = L // 2
    with torch.no_grad():
        full = ours.prefill(ids)
        ours.prefill(ids[:h])
        steps = ours.decode_path(ids[h:], h)
    assert torch.equal(steps.argmax(-1), full[h:].argmax(-1))
    assert (steps - full[h:]).abs().max() < 2e-3


# a tree of 8 nodes after the prefix; parent index per node (root first), as the engine lays trees out
PARENT = [-1, 0, 0, 1, 1, 2, 3, 5]


def test_tree_mask_equals_branches(case):
    """One pass over a token tree (ancestor mask, positions n + depth, slots n + i) gives every node the logits
    it gets when its branch alone is decoded after the same prefix."""
    key, ours, ids, _ = case
    n, N = 40, len(PARENT)
    tokens = ids[n:n + N].clone()
    tokens[2] = ids[5]  # siblings must differ for the branches to differ
    anc = torch.eye(N, dtype=torch.bool)
    for i, p in enumerate(PARENT):
        if p >= 0:
            anc[i] |= anc[p]
    depth = anc.sum(1) - 1
    with torch.no_grad():
        ours.prefill(ids[:n])
        tree = ours(tokens, n + depth, n + torch.arange(N), Span(torch.tensor(n), anc, n + N))
        leaves = [i for i in range(N) if i not in PARENT]
        assert len(leaves) == 3
        for leaf in leaves:
            path = anc[leaf].nonzero().flatten()  # root .. leaf (ancestors come first in tree order)
            branch = ours.decode_path(tokens[path], n)
            assert torch.equal(branch.argmax(-1), tree[path].argmax(-1)), f"{key}: branch to node {leaf}"
            assert (branch - tree[path]).abs().max() < 2e-3, f"{key}: branch to node {leaf}"
