"""Fixed-size KV-cache blocks out of one pool, handed to requests and taken back.

The pool is sized by a memory budget (`--kv-memory`): a fraction of the GPU's free memory when <= 1, else GiB
(on the CPU always GiB). An AR request's blocks grow with it (`grow`: the slots of each step, as it is scheduled),
so the pool holds the tokens that exist, not every request's worst case; when a step cannot have its blocks the
scheduler preempts (engine/scheduler.py). A speculative request gets, when it joins, every block it can ever use
(one `grow` to prompt + max_tokens + the slots a round writes past its committed length: its window and draft state
could not be recomputed token for token). One that can never fit, even alone, is refused.
Block 0 is kept out of the free list: padding rows of a batch bucket write there.

Prefix caching (`prefix_cache`): a request that leaves (finished, cancelled or preempted) registers its full blocks
under their tokens and the chain of blocks before them, and its blocks go back to the free list still holding their KV
(the target's, of its committed tokens, whichever method made them). A request that joins (AR's, or a speculative
method's that decodes as AR's: runner.shares_prefix) takes the longest run of registered blocks that starts its prompt
(`match`) and prefills only the rest: a conversation's next turn computes its new turn, not its history again, and a
preempted request resumes from its own blocks if they are still there. A block shared by running requests is counted
once per holder (`refs`) and goes back when the last lets it go; free blocks are handed out unregistered ones first,
then registered ones least recently freed first, the end of a run before its start (its start is what other prompts
share). vLLM's automatic prefix caching and SGLang's radix cache do the same; their writes into a shared block are
avoided the same way here: only full blocks are shared, and a prompt's last token is always computed (its logits give
the first token).
"""
from __future__ import annotations

import itertools
import os
from collections import OrderedDict

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
    def __init__(self, num_blocks: int, max_blocks_per_request: int, prefix_cache: bool = False):
        if num_blocks < 2:
            raise UserError(f"the KV-cache budget holds {num_blocks} blocks of {KV_BLOCK} slots; raise --kv-memory")
        self.num_blocks, self.max_blocks, self.prefix_cache = num_blocks, max_blocks_per_request, prefix_cache
        # free blocks in the order they are handed out, from the end: low ids first, then the last given back
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks - 1, 0, -1))
        self.owned: dict[int, list[int]] = {}  # request id -> its blocks
        self.refs = [0] * num_blocks  # holders of each block
        # prefix cache: (the key of the block before, or None; the block's tokens) -> block, and each registered
        # block's (key, serial); a serial is never reused, so a block handed out again orphans what followed it
        self.cached: dict[tuple, int] = {}
        self.key_of: dict[int, tuple[tuple, int]] = {}
        self.serials = itertools.count()

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

    def _take(self, n: int) -> list[int]:
        """n free blocks, each forgotten by the prefix cache."""
        out = [self.free.popitem()[0] for _ in range(n)]
        for b in out:
            self.refs[b] = 1
            if b in self.key_of:
                del self.cached[self.key_of.pop(b)[0]]
        return out

    def match(self, rid: int, tokens: list[int]) -> list[int]:
        """Request rid (holding nothing yet) takes the registered blocks that hold the longest run of full blocks
        starting `tokens`, the last token left out (it is to be computed); returns them (their KV is that of
        tokens[:KV_BLOCK * len(them)])."""
        assert rid not in self.owned
        got, parent = [], None
        if self.prefix_cache:
            for i in range((len(tokens) - 1) // KV_BLOCK):
                b = self.cached.get((parent, tuple(tokens[i * KV_BLOCK:(i + 1) * KV_BLOCK])))
                if b is None:
                    break
                got.append(b)
                parent = self.key_of[b][1]
        for b in got:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1
        self.owned[rid] = got
        return got

    def grow(self, rid: int, slots: int) -> list[int] | None:
        """Blocks so that request rid holds `slots` slots: the new ones (possibly none), or None (nothing taken)
        when the pool has too few free."""
        have = self.owned.setdefault(rid, [])
        need = self.blocks_for(slots) - len(have)
        if need <= 0:
            return []
        if need > len(self.free):
            return None
        new = self._take(need)
        have += new
        return new

    def held(self, rid: int) -> int:
        return len(self.owned.get(rid, ()))

    def release(self, rid: int, tokens: list[int] | None = None) -> None:
        """Give a request's blocks back (idempotent: finish, cancel and error paths may all call it). tokens: those
        whose KV its blocks hold, in order (prefix cache: its full blocks are registered under them)."""
        blocks = self.owned.pop(rid, [])
        if self.prefix_cache and tokens is not None:
            self._register(blocks, tokens)
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
                if b in self.key_of:  # handed out after the unregistered ones, the run's start last
                    self.free.move_to_end(b, last=False)

    def _register(self, blocks: list[int], tokens: list[int]) -> None:
        parent = None
        for i, b in enumerate(blocks[:len(tokens) // KV_BLOCK]):
            if b not in self.key_of:
                key = (parent, tuple(tokens[i * KV_BLOCK:(i + 1) * KV_BLOCK]))
                if key in self.cached:  # the same tokens in another block already: the chain goes on through it
                    parent = self.key_of[self.cached[key]][1]
                    continue
                self.cached[key] = b
                self.key_of[b] = (key, next(self.serials))
            parent = self.key_of[b][1]

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self.free)
