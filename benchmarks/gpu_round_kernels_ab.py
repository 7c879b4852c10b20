"""The round's small kernels on a GPU against what they replace (issue 38), medians of CUDA-graph replays with L2
flushed before each, as they run inside a round:
- tree_select at the default tree (k = 10, depth 5, N = 60: a 510-node pool) for B requests: the torch reference
  against the kernel;
- tree_accept of B such trees (max path 7): the torch reference against the kernel;
- the vocabulary top-k over rows of 151,936 logits (k = 3: K_ver / k_tree / K_pre): torch.topk, the grouped
  selection that vocab_top replaced at `2d7fa1d` (the before arm, kept here only), and vocab_top; torch.argmax beside
  layers.vocab_argmax (vocab_top at k = 1), which replaced it for greedy decoding.
`python -m plugins.check_layers --only tree_select tree_accept "vocab top-k"` checks each against its reference first.

    python benchmarks/gpu_round_kernels_ab.py [--batches 1,16,64] [--rows 1,60,64,256,480]
"""
from __future__ import annotations

import argparse

import torch

from plugins import layers


def grouped_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The before arm: each row's maximum per group of 128 strided ids, the k best groups, the top k of their ids."""
    T, V = logits.shape
    g = 128
    G = V // g
    M = G * g
    maxima = logits[:, :M].view(T, g, G).amax(1)
    if M < V:
        maxima = torch.cat([maxima, logits[:, M:].amax(-1, keepdim=True)], 1)
    groups = maxima.topk(k, -1).indices
    step = torch.arange(g, device=logits.device)
    ids = torch.where(groups[:, :, None] < G, groups[:, :, None] + G * step, M + step)
    vals = logits.gather(1, ids.clamp(max=V - 1).flatten(1))
    vals = vals.masked_fill(ids.flatten(1) >= V, float("-inf"))
    top, at = vals.topk(k, -1)
    return top, ids.flatten(1).gather(1, at)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--rows", default="1,60,64,256,480")
    a = ap.parse_args()
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    k, depth, N = 10, 5, 60
    P = k + depth * k * k
    print("\n| B | tree_select: reference us | kernel us | tree_accept: reference us | kernel us |\n|---|---:|---:|---:|---:|")
    for B in [int(x) for x in a.batches.split(",")]:
        g = torch.Generator().manual_seed(B)
        root = torch.randint(0, 50000, (B,), generator=g).cuda()
        tok = torch.randint(0, 50000, (B, P), generator=g).cuda()
        score = (-torch.rand(B, P, generator=g) * 20).cuda()
        best = torch.randint(0, k, (B, (depth - 1) * k), generator=g).cuda()
        with layers.path(False):
            tree = layers.tree_select(root, tok, score, best, k, N)
        choice = torch.where(torch.rand(B, N, generator=g).cuda() < 0.5, tree[0].gather(1, tree[1]), 7)
        times = []
        for fn in (lambda: layers.tree_select(root, tok, score, best, k, N),
                   lambda: layers.tree_accept(*tree, choice, depth + 2)):
            for fast in (False, True):
                with layers.path(fast):
                    times.append(layers._replay_us(fn, flush))
        print(f"| {B} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
    V, kk = 151936, 3
    print(f"\n| rows x {V} (bf16), k = {kk} | torch.topk us | grouped (before) us | vocab_top us | torch.argmax us "
          "| vocab_argmax us |\n|---|---:|---:|---:|---:|---:|")
    for T in [int(x) for x in a.rows.split(",")]:
        x = torch.randn(T, V, device="cuda", dtype=torch.bfloat16)
        ref, before, new = x.topk(kk, -1), grouped_topk(x, kk), layers.vocab_topk(x, kk)
        assert torch.equal(ref.values, new[0]) and torch.equal(before[0], new[0]), "values differ"
        assert torch.equal(layers.vocab_argmax(x), x.argmax(-1)), "argmax differs"
        times = [layers._replay_us(fn, flush) for fn in (lambda: x.topk(kk, -1), lambda: grouped_topk(x, kk),
                                                          lambda: layers.vocab_topk(x, kk), lambda: x.argmax(-1),
                                                          lambda: layers.vocab_argmax(x))]
        print(f"| {T} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


if __name__ == "__main__":
    main()
