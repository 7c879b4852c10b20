"""The round's tree selection on a GPU against its torch reference (issue 38): plugins.layers.tree_select at the
default tree (k = 10, depth 5, N = 60: a 510-node pool) for B requests, medians of CUDA-graph replays with L2
flushed before each, as it runs inside a round. `python -m plugins.check_layers --only tree_select` checks the two
agree (random pools, ties, NaN rows) first.

    python benchmarks/gpu_round_kernels_ab.py [--batches 1,16,64]
"""
from __future__ import annotations

import argparse

import torch

from plugins import layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    a = ap.parse_args()
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    k, depth, N = 10, 5, 60
    P = k + depth * k * k
    print("\n| tree_select | reference us | kernel us |\n|---|---:|---:|")
    for B in [int(x) for x in a.batches.split(",")]:
        g = torch.Generator().manual_seed(B)
        root = torch.randint(0, 50000, (B,), generator=g).cuda()
        tok = torch.randint(0, 50000, (B, P), generator=g).cuda()
        score = (-torch.rand(B, P, generator=g) * 20).cuda()
        best = torch.randint(0, k, (B, (depth - 1) * k), generator=g).cuda()
        times = []
        for fast in (False, True):
            with layers.path(fast):
                times.append(layers._replay_us(lambda: layers.tree_select(root, tok, score, best, k, N), flush))
        print(f"| B={B} | {times[0]:.1f} | {times[1]:.1f} |")


if __name__ == "__main__":
    main()
