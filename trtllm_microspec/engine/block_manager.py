"""Fixed-size KV-cache blocks out of one pool, handed to requests and taken back.

The pool is sized by a memory budget (`--kv-memory`): a fraction of the GPU's free memory when <= 1, else GiB
(on the CPU always GiB). An AR request's blocks grow with it (`grow`: the slots of each step, as it is scheduled),
so the pool holds the tokens that exist, not every request's worst case; when a step cannot have its blocks the
scheduler preempts (engine/scheduler.py). A speculative request gets, when it joins, every block it can ever use
(`allocate`: prompt + max_tokens + the slots a round writes past its committed length: its window and draft state
could not be recomputed token for token). One that can never fit, even alone, is refused.
Block 0 is kept out of the free list: padding rows of a batch bucket write there.
"""
from __future__ import annotations

import os

import torch

from plugins.layers import KV_BLOCK

from ..models.registry import UserError

GIB = 1 << 30


def block_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes of one block of a KVCache(cfg, cfg.num_layers, dtype): K and V of every layer in cfg's own KV shape
    (kv heads x head_dim) and the slots' positions (int64)."""
    return (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize + 8) * KV_BLOCK


def device_memory(device: torch.device) -> int:
    """Bytes of memory the device has in all (the CPU: the machine's RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(what: str, nbytes: float, device: torch.device) -> None:
    """Refuse a buffer larger than the whole device in one line, before its allocation fails deep in torch."""
    total = device_memory(device)
    if nbytes > total:
        raise UserError(f"{what} needs {nbytes / GIB:.4g} GiB; the {device.type} has {total / GIB:.4g} GiB in all")


def pool_blocks(kv_memory: float, bytes_per_block: int, device: torch.device) -> int:
    """How many blocks the budget holds."""
    if device.type == "cuda" and kv_memory <= 1:
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * kv_memory
    else:
        budget = kv_memory * GIB
        check_fits("the KV-cache pool (--kv-memory, in GiB here)", budget, device)
    return int(budget // bytes_per_block)


class BlockManager:
    def __init__(self, num_blocks: int, max_blocks_per_request: int):
        if num_blocks < 2:
            raise UserError(f"the KV-cache budget holds {num_blocks} blocks of {KV_BLOCK} slots; raise --kv-memory")
        self.num_blocks, self.max_blocks = num_blocks, max_blocks_per_request
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # popped from the end: low ids first
        self.owned: dict[int, list[int]] = {}  # request id -> its blocks

    @staticmethod
    def blocks_for(slots: int) -> int:
        return -(-slots // KV_BLOCK)

    @property
    def capacity(self) -> int:
        """Blocks one request may hold: the pool (less the padding block) or the engine's sequence limit."""
        return min(self.num_blocks - 1, self.max_blocks)

    def check(self, slots: int, what: str) -> None:
        """Refuse a request that could never run, whatever else is running."""
        need = self.blocks_for(slots)
        if need > self.capacity:
            limit = self.capacity * KV_BLOCK
            raise UserError(f"{what} needs {slots} cache slots; this engine holds at most {limit} per request "
                            f"(max_seq_len and --kv-memory)")

    def can_allocate(self, slots: int) -> bool:
        return self.blocks_for(slots) <= len(self.free)

    def allocate(self, rid: int, slots: int) -> list[int]:
        need = self.blocks_for(slots)
        assert rid not in self.owned and need <= len(self.free)
        self.owned[rid] = [self.free.pop() for _ in range(need)]
        return self.owned[rid]

    def grow(self, rid: int, slots: int) -> list[int] | None:
        """Blocks so that request rid holds `slots` slots: the new ones (possibly none), or None (nothing taken)
        when the pool has too few free."""
        have = self.owned.setdefault(rid, [])
        need = self.blocks_for(slots) - len(have)
        if need <= 0:
            return []
        if need > len(self.free):
            return None
        new = [self.free.pop() for _ in range(need)]
        have += new
        return new

    def held(self, rid: int) -> int:
        return len(self.owned.get(rid, ()))

    def release(self, rid: int) -> None:
        """Give a request's blocks back (idempotent: finish, cancel and error paths may all call it)."""
        self.free += reversed(self.owned.pop(rid, []))

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self.free)
