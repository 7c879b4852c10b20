"""The round's draft-head and tree-selection kernels on a GPU, against the path they replace (issue 38).

The draft head of a MicroSpec round (plugins.layers.window_head) at qwen2.5-coder-1.5b's shapes (d = 1,536,
W_max = 3,072 window rows after 3,072 fill rows, k = 10): the Triton kernel in each config (BLOCK_N, BLOCK_K, pipeline stages) against the reference
path (a gather of each request's rows, cuBLAS GEMMs, a concatenation and the fused log-softmax + top-k CUDA kernel
of plugins/cuda.py), with half of the 6,144 scored rows live as in a round (a window of 1,000 ids, the fill's kept
ids filling the rest). Then tree_select (k = 10, depth 5, N = 60) against its torch reference. Medians of CUDA-graph
replays with L2 flushed before each, as the kernels run inside a round; every kernel is checked against its
reference first (python -m plugins.check_layers --only window_head tree_select does so on random inputs).

    python benchmarks/gpu_round_kernels_ab.py [--batches 1,16,64]
"""
from __future__ import annotations

import argparse

import torch

from plugins import layers, triton_layers


CONFIGS = [(32, 128, 4), (64, 128, 4), (64, 256, 3), (128, 128, 4)]  # (BLOCK_N, BLOCK_K, stages)


def window_case(B: int, T: int, F: int = 3072, R: int = 3072, d: int = 1536, window: int = 1000):
    g = torch.Generator().manual_seed(B * 100 + T)
    hidden = torch.randn(B, T, d, generator=g).cuda().bfloat16()
    fill = torch.randn(F, d, generator=g).cuda().bfloat16() * 0.05
    packed = torch.randn(B + 1, R + 1, d, generator=g).cuda().bfloat16() * 0.05
    ids = torch.randperm(150000, generator=g)[:F + R]
    id_of = torch.full((B, F + R), -1, dtype=torch.long)
    id_of[:, F:F + window] = ids[F:F + window]  # the window's first slots
    keep = F + R // 2 - window  # the fill's kept ids: the first ones not in the window, up to W_max in all
    id_of[:, :keep] = ids[:keep]
    batch = torch.arange(B).cuda()  # slots 0 .. B-1: top = B
    return hidden, fill, packed[:B], batch, None if B == 1 else batch, id_of.cuda(), R


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    a = ap.parse_args()
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\n| draft head call | rows | reference us | " + " | ".join(f"kernel {c} us" for c in CONFIGS)
          + " |\n|---|---:|---:|" + "---:|" * len(CONFIGS))
    total = [0.0] * len(CONFIGS)
    for B in [int(x) for x in a.batches.split(",")]:
        for T in (1, 10):
            hidden, fill, packed, read, into, id_of, R = window_case(B, T)
            with layers.path(False):
                ref = layers._replay_us(lambda: layers.window_head(hidden, fill, packed, read, into, id_of, R, 10),
                                        flush)
                want = layers.window_head(hidden, fill, packed, read, into, id_of, R, 10)
            cells = []
            for c in CONFIGS:
                got = triton_layers.window_head(hidden, fill, packed, read, id_of, R, 10, config=c)
                ok = torch.allclose(got[0], want[0], atol=2e-2, rtol=0) and (got[1] == want[1]).float().mean() > 0.9
                us = layers._replay_us(lambda c=c: triton_layers.window_head(hidden, fill, packed, read, id_of, R,
                                                                              10, config=c), flush)
                cells.append(f"{us:.1f}" + ("" if ok else " (DIFFERS)"))
                total[len(cells) - 1] += us if ok else float("inf")
            print(f"| B={B} T={T} | {B * T} | {ref:.1f} | " + " | ".join(cells) + " |")
    best = min(range(len(CONFIGS)), key=total.__getitem__)
    print(f"\nfastest config over these calls: {','.join(map(str, CONFIGS[best]))}")
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
