"""The Triton layer kernels (plugins/triton_layers.py) against their torch reference (plugins/layers.py), run on
the CPU by Triton's interpreter: every op on random inputs (tree, causal, draft-expansion and windowed attention
spans, a split span, a batched step's packed chunks and decode rows in one launch, expanded positions; the
projections' skinny GEMM in every config, bf16 and fp32) and whole forwards of small random Llama, Qwen2 and
Gemma-3 models (one request, a paged batch, packed passes). The same check runs on a GPU with
`python -m plugins.check_layers` (bf16 and fp32, the real shapes)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_triton_kernels_match_the_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "plugins.check_layers", "--device", "cpu"], env=env,
                       capture_output=True, text=True, timeout=900)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, "\n".join(l for l in lines if not l.startswith("PASS")) + r.stderr[-2000:]
    assert " passed in " in lines[-1] and any(l.startswith("PASS") and "model gemma3" in l for l in lines)
    # a batched step's packed pass in one attention launch: chunks + decodes, windowed, and whole models
    assert any(l.startswith("PASS") and "packed attention" in l and "window=8" in l for l in lines)
    assert any(l.startswith("PASS") and "model gemma3 packed" in l for l in lines)
    assert any(l.startswith("PASS") and "vocab top-k" in l and "k=10" in l for l in lines)
    assert any(l.startswith("PASS") and "move_slots" in l for l in lines)  # the accepted path's KV, every layer
    # a round's tree bookkeeping: the growth step and the selection (the GPU's tree shape, ties too)
    assert any(l.startswith("PASS") and "tree_grow" in l and "k=10 depth=5" in l for l in lines)
    assert any(l.startswith("PASS") and "tree_select" in l and "k=10 depth=5 N=60" in l for l in lines)
    assert any(l.startswith("PASS") and "tree_accept" in l and "k=10 depth=5 N=60" in l for l in lines)
    skinny = [l for l in lines if "skinny linear" in l]  # every config, both dtypes, split-K and both activations
    assert all(any(w in l for l in skinny) for w in ("bfloat16", "float32", "act=silu", "act=gelu", "bias=True"))
    assert any("/2" in l.split("configs")[1] for l in skinny if "bfloat16" in l)  # K split in 2, both dtypes
    assert any("/2" in l.split("configs")[1] for l in skinny if "float32" in l)
    fused = [l for l in lines if l.startswith("PASS") and "norm_linear" in l]  # the add + RMSNorm prologue
    assert all(any(w in l for l in fused) for w in ("bfloat16", "float32", "add=True", "add=False", "offset=1"))
    assert any("/2" in l.split("configs")[1] for l in fused)  # split K: the row norms summed over the splits
    assert any("rope_cache_write (skinny" in l and "/2" in l.split("configs")[1] for l in fused)  # + the rotation


def test_linear_choices_are_kept_across_processes(tmp_path, monkeypatch):
    """A measured choice is written to the choices file and a fresh process (empty memory) runs it without
    measuring; keyed by device, versions and the kernels' source; a damaged file means measuring again."""
    import json

    import torch

    from plugins import layers

    path = tmp_path / "choices.json"
    monkeypatch.setenv("MICROSPEC_LINEAR_CHOICES", str(path))
    monkeypatch.setattr(layers, "_LINEAR", {})
    monkeypatch.setattr(layers, "_DISK", None)
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    key = layers._disk_key((x.device, 32, 64, 4, x.dtype, False, None))  # 3 rows: the bucket of 4
    layers._remember(key, {"config": (16, 64, 1), "torch_us": 10.0, "triton_us": 5.0})
    saved = json.loads(path.read_text())
    assert list(saved) == [key] and "triton" in key and "kernels" in key and saved[key]["config"] == [16, 64, 1]
    monkeypatch.setattr(layers, "_LINEAR", {})
    monkeypatch.setattr(layers, "_DISK", None)  # a fresh process
    assert layers.linear_choice(x, w, None, None)["config"] == (16, 64, 1)
    assert layers.linear_choice(x[:1], w, None, None)["config"] is None  # another bucket: not measured on a CPU
    path.write_text("{not json")
    monkeypatch.setattr(layers, "_LINEAR", {})
    monkeypatch.setattr(layers, "_DISK", None)
    with pytest.warns(UserWarning, match="unreadable"):
        assert layers.linear_choice(x, w, None, None)["config"] is None


@pytest.mark.parametrize("M, fp32, act, norm, rope", [(1, False, True, False, False), (60, True, True, False, False),
                                                       (60, False, False, False, False), (1, False, False, True, False),
                                                       (60, False, False, True, True), (1, False, False, True, True)])
def test_skinny_gemm_builds_for_hopper_with_a_pipelined_k_loop(M, fp32, act, norm, rope):
    """Every config the GPU may measure compiles for sm_90 (no GPU needed), streams its weight through cp.async
    (a K loop that is not pipelined would leave the skinny GEMM latency-bound) and fits in shared memory; with
    the down projection's activation or the add + RMSNorm in its prologue, the rotation + KV write in its
    epilogue too."""
    from plugins.check_layers import build_skinny_for_hopper
    from plugins.triton_layers import skinny_configs

    for config in skinny_configs(M, 1536, 8960, fp32):
        smem, pipelined = build_skinny_for_hopper(M, config, fp32, act, bias=True, norm=norm, rope=rope)
        assert pipelined and smem <= 160 * 1024, (config, smem)


def test_attention_choice_candidates_and_kept_choices(tmp_path, monkeypatch):
    """attention_plan's candidates: where it splits the keys, the same plan in one launch; where it runs one
    program per (request, kv head) over the whole span (T = 1, many requests), wider key blocks, more warps, two
    splits (and those in one launch); none elsewhere. A kept choice (the choices file) is what attention then
    runs; on a CPU nothing is measured and the checks (layers.path) always take attention_plan's."""
    import torch

    from plugins import layers
    from plugins import triton_layers as tk

    # qwen2.5-coder-1.5b's heads: 12 q heads over 2 kv heads of 128
    plan = lambda T, B: tk.attention_plan(T, 6, 2, 640, 128, B=B)  # noqa: E731
    cands = lambda T, B: tk.attention_candidates(T, 6, 2, 640, 128, B)  # noqa: E731
    big = cands(1, 256)
    assert plan(1, 256)[2] == 1 and plan(1, 256) not in big and len(big) > 2
    assert any(len(p) == 5 and p[4] and p[2] > 1 for p in big)  # two splits, merged in the one launch
    for T, B in [(1, 4), (60, 1), (10, 8)]:  # a decode step of few requests, a tree, a draft step: split keys
        assert plan(T, B)[2] > 1 and cands(T, B) == [(*plan(T, B), True)]
    assert plan(512, 16)[2] == 1 and cands(512, 16) == []  # prompt chunks of many requests: no candidate
    monkeypatch.setenv("MICROSPEC_LINEAR_CHOICES", str(tmp_path / "choices.json"))
    monkeypatch.setattr(layers, "_LINEAR", {})
    monkeypatch.setattr(layers, "_DISK", None)
    B, S = 256, 640
    q, k = torch.randn(B, 12, 128), torch.randn(2, 8, 128)
    table = torch.zeros(B, S // layers.KV_BLOCK, dtype=torch.long)
    span = layers.Span(torch.zeros(B, dtype=torch.long), torch.ones(B, 1, 1, dtype=torch.bool), S, table)
    args = (q, k, k, span, None, None, 0, 0.1)
    assert layers.attention_choice(*args) is None  # a CPU: not measured, attention_plan's
    assert [layers.span_bucket(s) for s in (1, 64, 65, 600, 640, 1024, 1025)] == [64, 64, 128, 1024, 1024, 1024, 2048]
    key = layers._disk_key((q.device, "attention", 12, 2, 128, 1, B, layers.span_bucket(S), q.dtype, False))
    one = next(p for p in big if len(p) == 5)
    layers._remember(key, {"config": one, "torch_us": 80.0, "triton_us": 50.0})
    monkeypatch.setattr(layers, "_LINEAR", {})
    monkeypatch.setattr(layers, "_DISK", None)  # a fresh process
    assert layers.attention_choice(*args) == one
    # an eager step's exact context in the same bucket takes the kept choice (measured once per bucket, not per token)
    near = layers.Span(span.n, span.new, 1000, torch.zeros(B, 1000 // layers.KV_BLOCK + 1, dtype=torch.long))
    assert layers.attention_choice(q, k, k, near, None, None, 0, 0.1) == one
    far = layers.Span(span.n, span.new, 1100, torch.zeros(B, 1100 // layers.KV_BLOCK + 1, dtype=torch.long))
    assert layers.attention_choice(q, k, k, far, None, None, 0, 0.1) is None  # another bucket: not measured here
    with layers.path(True):
        assert layers.attention_choice(*args) is None
    small = layers.Span(torch.zeros(4, dtype=torch.long), torch.ones(4, 1, 1, dtype=torch.bool), S, table[:4])
    assert layers.attention_choice(q[:4], k, k, small, None, None, 0, 0.1) is None
