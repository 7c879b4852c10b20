"""The model runner of the batched engine: a paged KV pool, per-request device state in batch slots, chunked
prefill of one request, and one target pass per step for the whole batch.

Each running request holds a batch slot: its row of the block table lives on the device from join to leave.
A step's inputs (last token, committed length, slot of each row) are copied from the host into one persistent
buffer, so the step itself has no host reads; on CUDA it is captured in a graph per (batch-size bucket, span
bucket) and replayed, rows past the real batch padded with a request of length 0 whose table points at the
pool's block 0 (never handed out).
"""
from __future__ import annotations

import torch

from plugins.layers import KV_BLOCK

from ..models.model import KVCache, Span, Transformer
from ..models.registry import UserError
from ..spec.tree import causal
from .block_manager import BlockManager, pool_blocks
from .graphs import GraphRunner, bucket_for

DEFAULT_KV_MEMORY = {"cuda": 0.5, "cpu": 0.5}  # fraction of free GPU memory / GiB on the CPU


def batch_bucket(B: int, max_batch: int) -> int:
    b = 1
    while b < B:
        b *= 2
    return min(b, max_batch)


class BatchRunner:
    def __init__(self, target: Transformer, max_batch: int, kv_memory: float | None = None,
                 cuda_graphs: bool = False):
        c, dev, dtype = target.cfg, target.cache.k.device, target.cache.k.dtype
        self.target, self.max_batch, self.device = target, max_batch, dev
        self.stop_ids = list(c.eos_ids)
        self.reserve = 1  # slots a step writes past the committed length
        kv_memory = kv_memory or DEFAULT_KV_MEMORY[dev.type]
        per_block = 2 * c.num_layers * c.num_kv_heads * KV_BLOCK * c.head_dim * dtype.itemsize + 8 * KV_BLOCK
        width = -(-c.max_seq_len // KV_BLOCK)  # table columns: S buckets reach up to max_seq_len
        self.blocks = BlockManager(pool_blocks(kv_memory, per_block, dev), c.max_seq_len // KV_BLOCK)
        self.cache = KVCache(c, c.num_layers, dtype, dev, slots=self.blocks.num_blocks * KV_BLOCK)
        # one table row per batch slot, plus the padding slot (all block 0)
        self.table = torch.zeros(max_batch + 1, width, dtype=torch.long, device=dev)
        self.pad = max_batch
        self.free_slots = list(range(max_batch - 1, -1, -1))
        self.inp = torch.zeros(3, max_batch, dtype=torch.long, device=dev)  # rows: last token, n, batch slot
        self.next = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.one = causal(1, dev)[None]
        self.graphs = GraphRunner() if cuda_graphs else None

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise UserError("the prompt is empty")
        if max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if max(prompt) >= self.target.cfg.vocab_size or min(prompt) < 0:
            raise UserError("the prompt has token ids outside the vocabulary")

    def slots_for(self, prompt: list[int], max_new_tokens: int) -> int:
        return len(prompt) + max_new_tokens + self.reserve

    def join(self, req, blocks: list[int]) -> None:
        req.slot = self.free_slots.pop()
        row = torch.zeros(self.table.shape[1], dtype=torch.long)
        row[:len(blocks)] = torch.tensor(blocks)
        self.table[req.slot].copy_(row)

    def leave(self, req) -> None:
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1

    def prefill(self, req, chunk: int) -> list[int] | None:
        """The next `chunk` prompt tokens of one request; its first token once the whole prompt is in."""
        t, a = self.target, req.prefilled
        b = a + chunk
        ids = torch.tensor(req.prompt[a:b], device=self.device)
        pos = torch.arange(a, b, device=self.device)
        n = torch.tensor([a], device=self.device)
        h = t(ids, pos, pos, Span(n, causal(chunk, self.device), b, self.table[req.slot:req.slot + 1]),
              cache=self.cache)
        req.prefilled = req.n = b
        if b < len(req.prompt):
            return None
        req.last = int(t.logits(h[-1:]).argmax(-1))
        return [req.last]

    def decode(self, reqs: list) -> list[list[int]]:
        """One AR step for the batch: one target pass over one row per request."""
        B = len(reqs)
        Bb = batch_bucket(B, self.max_batch) if self.graphs else B
        rows = [(r.last, r.n, r.slot) for r in reqs] + [(0, 0, self.pad)] * (Bb - B)
        self.inp[:, :Bb].copy_(torch.tensor(rows).T)
        S = max(r.n for r in reqs) + 1
        if self.graphs:
            S = bucket_for(S, self.target.cfg.max_seq_len)
            self.graphs.begin_round((Bb, S))
            self.graphs("decode", (Bb, S), lambda: self._decode(Bb, S))
        else:
            self._decode(Bb, S)
        out = self.next[:B].tolist()  # the one host read per step
        for r, tok in zip(reqs, out):
            r.n += 1
            r.last = tok
        return [[tok] for tok in out]

    def _decode(self, Bb: int, S: int) -> None:
        tok, n, slot = self.inp[0, :Bb], self.inp[1, :Bb], self.inp[2, :Bb]
        span = Span(n, self.one.expand(Bb, 1, 1), S, self.table.index_select(0, slot))
        h = self.target(tok, n, n, span, cache=self.cache)
        self.next[:Bb].copy_(self.target.logits(h).argmax(-1))
