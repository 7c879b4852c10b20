"""The host's cost of launching each layer op (issue 36: an eager step with prompt chunks, ~300 launches for
qwen2.5-coder-1.5b's 28 layers, took ~16 ms on the H200 where its rows' GPU work is ~4 ms).

Each op runs N times back to back on tiny inputs (its GPU time a few us, so the host's launch rate is what the loop
measures) after a warm-up (Triton's compile): host us per launch = the loop's wall / N without a sync inside, and
the GPU's us per launch (CUDA events around the loop). A host time above the GPU's is an op whose launch, not its
work, sets the pace of an eager step. Beside them: torch's own launch (an add) and cuBLAS's (a small GEMM).

    python benchmarks/gpu_launch_overhead.py [--n 2000]
"""
from __future__ import annotations

import argparse
import time

import torch

from plugins import layers
from plugins.layers import Span, Spans
from trtllm_microspec.speculative.tree import causal


def timed(fn, n: int, cuda: bool) -> tuple[float, float | None]:
    """(host us, GPU us) per call of fn over n back-to-back calls (the CPU: no GPU time)."""
    for _ in range(3):
        fn()
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6, None
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return host / n * 1e6, start.elapsed_time(end) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--device", default="cuda", help="cpu: the torch reference, a check of the script")
    a = p.parse_args()
    dev, dt = torch.device(a.device), torch.bfloat16
    cuda = dev.type == "cuda"
    H, KV, D, d, inter, T = 12, 2, 128, 1536, 8960, 8  # qwen2.5-coder-1.5b's heads and widths, 8 rows
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dt)

    x, w, wd = rand(T, d), rand(d), rand(d, inter)
    gate_up, qkv = rand(T, 2 * inter), rand(T, (H + 2 * KV) * D)
    slots = 4096
    k_cache, v_cache, k_pos = rand(KV, slots, D), rand(KV, slots, D), torch.arange(slots, device=dev)
    rope = (torch.randn(slots, D // 2, device=dev), torch.randn(slots, D // 2, device=dev))
    pos = torch.arange(100, 100 + T, device=dev)
    q = rand(T, H, D)
    tri = causal(T, dev)
    span = Span(torch.tensor(100, device=dev), tri, 100 + T)
    # a packed pass: two prompt chunks of T rows and T decode rows, each over its own table row
    table = torch.arange(3 * T + 2, device=dev).view(-1, 1).expand(-1, 8).contiguous()
    parts = [Span(torch.tensor([100], device=dev), tri[None], 100 + T, table[i:i + 1]) for i in range(2)]
    parts.append(Span(torch.full((T,), 100, device=dev), causal(1, dev)[None].expand(T, 1, 1), 101, table[2:2 + T]))
    spans = Spans(parts, causal=True)
    qp, pos_p = rand(3 * T, H, D), torch.full((3 * T,), 100, device=dev)
    ops = {
        "torch add (reference point)": lambda: torch.add(x, 1.0),
        "cuBLAS GEMM [8 x 1536] x [1536 x 8960]": lambda: torch.nn.functional.linear(x, wd.t()),
        "add_rms_norm": lambda: layers.add_rms_norm(x, x, w, 1e-6, 0.0),
        "rms_norm": lambda: layers.rms_norm(x, w, 1e-6, 0.0),
        "act_mul": lambda: layers.act_mul(gate_up, False),
        "rope_cache_write": lambda: layers.rope_cache_write(qkv, H, KV, rope, pos, pos, k_cache, v_cache, None, 1e-6),
        "attention (a Span)": lambda: layers.attention(q, k_cache, v_cache, span, pos, k_pos, 0, D ** -0.5),
        "attention (packed Spans: 2 chunks + decodes)": lambda: layers.attention(qp, k_cache, v_cache, spans, pos_p,
                                                                                 k_pos, 0, D ** -0.5),
    }
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}; {a.n} back-to-back "
          f"launches each, host us and GPU us per launch")
    print(f"{'op':48s} {'host us':>8s} {'GPU us':>8s}")
    with torch.no_grad():
        for name, fn in ops.items():
            host, gpu = timed(fn, a.n, cuda)
            print(f"{name:48s} {host:8.1f} {'-' if gpu is None else f'{gpu:8.1f}':>8s}", flush=True)


if __name__ == "__main__":
    main()
