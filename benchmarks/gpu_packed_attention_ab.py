"""Issue 21: one layer's attention over a batched step's packed pass (prompt chunks + decode rows, layers.Spans),
the per-part loop (today's path: SDPA for chunks of >= LONG_ROWS rows, _attn_kernel for the rest) against the one
launch of a causal Spans (triton_layers.attention_varlen), on the same random inputs; prints their agreement and
the milliseconds per call, eager as a packed step runs it (host launches included) and per layer of the model.

  python benchmarks/gpu_packed_attention_ab.py                 # qwen2.5-coder-1.5b's heads, bf16, the profile's step
  python benchmarks/gpu_packed_attention_ab.py --chunks 4 --chunk-rows 2048 --decodes 64

On a CPU (a smoke test) run it with TRITON_INTERPRET=1 and small shapes: both paths then run the kernels."""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

from plugins import layers
from plugins.layers import KV_BLOCK, Span, Spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunks", type=int, default=16, help="prompt chunks in the pass")
    p.add_argument("--chunk-rows", type=int, default=512)
    p.add_argument("--context", type=int, default=512, help="a chunk's committed slots are 0 .. context - rows")
    p.add_argument("--decodes", type=int, default=256, help="decode rows (one request each)")
    p.add_argument("--decode-context", type=int, default=600)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    H, KV, D, T = a.heads, a.kv_heads, a.head_dim, a.chunk_rows
    reqs = [(int(torch.randint(0, max(1, a.context - T + 1), (1,), generator=g)), T) for _ in range(a.chunks)]
    reqs += [(int(torch.randint(1, a.decode_context, (1,), generator=g)), 1) for _ in range(a.decodes)]
    blocks = -(-max(n + t for n, t in reqs) // KV_BLOCK)
    pool = len(reqs) * blocks + 1
    table = torch.randperm(pool, generator=g)[:len(reqs) * blocks].view(len(reqs), blocks).to(dev)
    k = torch.randn(KV, pool * KV_BLOCK, D, generator=g).to(dev, dtype)
    v = torch.randn(KV, pool * KV_BLOCK, D, generator=g).to(dev, dtype)
    k_pos = torch.arange(pool * KV_BLOCK, device=dev)
    tri = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    parts = [Span(torch.tensor([n], device=dev), tri[None], n + t, table[i:i + 1])
             for i, (n, t) in enumerate(reqs[:a.chunks])]
    if a.decodes:
        ns = torch.tensor([n for n, _ in reqs[a.chunks:]], device=dev)
        parts.append(Span(ns, tri[None, :1, :1].expand(a.decodes, 1, 1), int(ns.max()) + 1, table[a.chunks:]))
    rows = sum(t for _, t in reqs)
    q = torch.randn(rows, H, D, generator=g).to(dev, dtype)
    q_pos = torch.cat([n + torch.arange(t) for n, t in reqs]).to(dev)
    if not cuda:
        from plugins.check_layers import fix_interpreter
        fix_interpreter()
    print(f"{a.chunks} chunks x {T} rows + {a.decodes} decode rows = {rows} rows, H={H}/{KV} D={D} {dtype} on {dev}")
    outs = {}
    for name, causal in (("per-part loop", False), ("one launch", True)):
        def call():  # a fresh Spans per pass, as each step builds one (its tiles / masks built on the first layer)
            spans = Spans(parts, causal=causal)
            return [layers.attention(q, k, v, spans, q_pos, k_pos, 0, D ** -0.5) for _ in range(a.layers)][-1]

        with contextlib.nullcontext() if cuda else layers.path(True), torch.no_grad():
            outs[name] = call()  # warm-up: compiles
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                call()
            if cuda:
                torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / a.iters * 1e3
        print(f"{name:14s} {ms:8.2f} ms per pass of {a.layers} layers ({ms / a.layers:.3f} ms a layer)")
    ref, got = outs["per-part loop"].double(), outs["one launch"].double()
    print(f"agreement |one - loop| / |loop| = {float((got - ref).norm() / ref.norm()):.2e}")


if __name__ == "__main__":
    main()
