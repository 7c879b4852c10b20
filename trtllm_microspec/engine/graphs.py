"""CUDA graphs captured by hand, one per (phase, bucket key): the key is whatever changes the captured work, the
KV-length bucket, the batch-size bucket, the sampling mode and (speculative) the tree shape and head-slots bucket.

A phase is a function that reads and writes persistent tensors (state updated in place) and may leave
new tensors as attributes for the next phase. The first round of a bucket runs every phase eagerly (this
is also the warm-up: cuBLAS handles, allocator); the second round captures each phase and replays it; after
that phases only replay. All phases of a round use the same bucket, so a captured phase always reads the
tensors produced by the captured phase before it. Capturing executes nothing, so no state is applied twice.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch

from plugins.layers import span_bucket


class GraphRunner:
    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()  # phases run one at a time: they share one memory pool
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.rounds_seen: dict[int, int] = {}
        self.first_uses = 0  # calls that did not replay (a key's eager run, then its capture): not the steady state

    def begin_round(self, bucket: Hashable) -> None:
        self.rounds_seen[bucket] = self.rounds_seen.get(bucket, 0) + 1

    def __call__(self, name: str, bucket: Hashable, fn) -> None:
        key = (name, bucket)
        g = self.graphs.get(key)
        if g is None:
            self.first_uses += 1
            if self.rounds_seen[bucket] < 2:
                fn()
                return
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                fn()
            self.graphs[key] = g
        g.replay()


def bucket_for(need: int, max_seq: int, smallest: int = 256) -> int:
    """The KV span a graph attends over: the next power of two >= need (at least `smallest`), capped at the cache
    length; attention_choice keys its measurements by the same buckets."""
    return min(span_bucket(need, smallest), max_seq)
