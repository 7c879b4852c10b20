"""MicroSpec's custom ops (torch.library), with the plain-torch reference that the CPU path runs.

The reference implementations are themselves free of host synchronisation and have static shapes, so they
can be captured in CUDA graphs too; `plugins.cuda` registers fused CUDA kernels for the same ops when the
extension builds (GPU machines only) and the tests / device checks compare the two on random inputs.

Window state: the MicroSpec windows of a batch's slots (trtllm_microspec/vocab/batched.py), all device tensors
with a leading window dimension; one sentinel entry at the end of each row absorbs padded writes:
  ring    [slots, W+1]  int64  the last W stream entries of each window (-1 = empty); ring[:, W] is the sentinel
  head    [slots]       int64  number of entries ever appended
  count   [slots, V+1]  int32  how many times each id occurs in the ring
  slot_of [slots, V+1]  int64  packed-buffer slot of each active id, -1 if inactive
  id_of   [slots, R+1]  int64  id held by each packed slot, -1 if free
  first   [slots, V+1]  int64  scratch for first-occurrence de-duplication, all = BIG between calls
Pinned ids (EOS ...) get a slot and a count of 1 at start that no eviction removes, so they never leave.
The window ops take ids [B, n] (-1 = padding) and batch [B]: row b works on window batch[b] alone (one CUDA
block per row; a single window is a batch of one row). The windows of batch are distinct, but for rows of
padding only (all -1), which change nothing.
"""
from __future__ import annotations

import torch

BIG = 1 << 62
REFERENCE = {}  # op name -> its plain-torch body, still callable on any device after CUDA kernels are registered


def _op(name: str, mutates_args=()):
    """torch.library.custom_op `microspec::name` whose body is the reference; the check and the A/B benchmark
    call REFERENCE[name] on CUDA tensors to compare it with the kernels that plugins.cuda registers."""
    def wrap(fn):
        REFERENCE[name] = fn
        return torch.library.custom_op(f"microspec::{name}", fn, mutates_args=mutates_args)
    return wrap


@_op("unique_first_rows", mutates_args=("first",))
def unique_first_rows(ids: torch.Tensor, first: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """ids [B, n] (-1 = padding) -> each row with every repeat after the row's first occurrence of an id replaced
    by -1; first [slots, V+1] the scratch of each window (all = BIG between calls), row b uses batch[b]'s."""
    B, n = ids.shape
    flat, sentinel = first.view(-1), first.shape[1] - 1
    at = batch[:, None] * first.shape[1] + torch.where(ids >= 0, ids, sentinel)
    idx = torch.arange(n, device=ids.device).expand(B, n)
    flat.scatter_reduce_(0, at.flatten(), idx.flatten(), reduce="amin")
    keep = (flat[at] == idx) & (ids >= 0)
    flat.index_fill_(0, at.flatten(), BIG)  # leave the scratch clean for the next call
    return torch.where(keep, ids, -1)


@unique_first_rows.register_fake
def _(ids, first, batch):
    return torch.empty_like(ids)


@_op("window_update_rows", mutates_args=("ring", "head", "count", "slot_of", "id_of", "first"))
def window_update_rows(ring: torch.Tensor, head: torch.Tensor, count: torch.Tensor, slot_of: torch.Tensor,
                       id_of: torch.Tensor, first: torch.Tensor, new_ids: torch.Tensor,
                       batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append row b of new_ids [B, n] (-1 = padding, skipped) to the FIFO stream of window batch[b], evict what
    falls out of the window, and give newly active ids a free slot. Returns (ids, slots) [B, 2n]: the rows to
    gather, slots within each window's packed rows (R for padding)."""
    B, n = new_ids.shape
    W, V, R = ring.shape[1] - 1, count.shape[1] - 1, id_of.shape[1] - 1
    if n == 0:
        return new_ids.new_empty(B, 0), new_ids.new_empty(B, 0)
    # each window's row through flat views (window * row length + index): no row reads or writes another's
    ring_f, count_f, slot_f, id_f = (t.view(-1) for t in (ring, count, slot_of, id_of))
    at_ring, at_v, at_r = (batch[:, None] * width for width in (W + 1, V + 1, R + 1))
    valid = new_ids >= 0
    rank = torch.cumsum(valid.long(), 1) - 1
    m = rank[:, -1:] + 1
    keep = valid & (rank >= m - W)  # only the last W entries of one append can stay in the window
    pos = at_ring + torch.where(keep, (head[batch, None] + rank) % W, W)
    evicted = torch.where(keep, ring_f[pos], -1)  # the entry this one overwrites (-1 while the ring is filling)
    added = torch.where(keep, new_ids, -1)
    ring_f.index_copy_(0, pos.flatten(), added.flatten())
    touched = torch.cat([evicted, added], 1)
    at = at_v + torch.where(touched >= 0, touched, V)  # padding: the row's sentinel V
    ones = torch.ones(B * n, dtype=count.dtype, device=count.device)
    count_f.index_add_(0, at[:, :n].flatten(), ones, alpha=-1)  # the evicted ids
    count_f.index_add_(0, at[:, n:].flatten(), ones)  # the added ones
    count[:, V:].fill_(0)
    ring[:, W:].fill_(-1)
    head.index_add_(0, batch, m[:, 0])
    # free the slots of ids that left the window (idempotent, so repeats need no de-duplication)
    gone = (touched >= 0) & (count_f[at] == 0) & (slot_f[at] >= 0)
    id_f.index_fill_(0, (at_r + torch.where(gone, slot_f[at], R)).flatten(), -1)
    slot_f.index_fill_(0, torch.where(gone, at, at_v + V).flatten(), -1)
    # give each id that entered the window (counted once) the window's next free slot, in order of appearance
    entered = (touched >= 0) & (count_f[at] > 0) & (slot_f[at] < 0)
    fresh = unique_first_rows(torch.where(entered, touched, -1), first, batch)
    is_new = fresh >= 0
    free = id_of[batch, :R] < 0
    free_rank = torch.cumsum(free.long(), 1) - 1
    slot_by_rank = torch.full((B, R + 1), R, dtype=torch.long, device=ring.device)
    slot_by_rank.scatter_(1, torch.where(free, free_rank, R), torch.arange(R, device=ring.device).expand(B, R))
    slot_by_rank[:, R:].fill_(R)
    new_rank = torch.cumsum(is_new.long(), 1) - 1
    slots = torch.where(is_new, slot_by_rank.gather(1, new_rank.clamp(0, R)), R)
    ids = torch.where(is_new, fresh, V)
    slot_f.index_copy_(0, (at_v + ids).flatten(), slots.flatten())
    id_f.index_copy_(0, (at_r + slots).flatten(), ids.flatten())
    slot_of[:, V:].fill_(-1)
    id_of[:, R:].fill_(-1)
    return torch.where(is_new, fresh, 0), slots


@window_update_rows.register_fake
def _(ring, head, count, slot_of, id_of, first, new_ids, batch):
    B, n = new_ids.shape
    return new_ids.new_empty(B, 2 * n), new_ids.new_empty(B, 2 * n)


@_op("gather_rows", mutates_args=("dst",))
def gather_rows(src: torch.Tensor, ids: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[slots[i]] = src[ids[i]]; the caller points padding at the last row of dst, a spare row whose content
    is unspecified afterwards (the CUDA kernel skips the rows aimed at it)."""
    dst.index_copy_(0, slots, src.index_select(0, ids))


@_op("packed_head")
def packed_head(hidden: torch.Tensor, packed: torch.Tensor, id_of: torch.Tensor,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft LM head over the packed rows: log-softmax over the active slots, top-k, slots -> token ids.
    hidden [T, d], packed [R, d], id_of [R] (-1 = empty slot) -> (logp [T, k] fp32, ids [T, k])."""
    logits = torch.nn.functional.linear(hidden, packed).float()
    logits = logits.masked_fill(id_of < 0, float("-inf"))
    logp, slot = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return logp, id_of[slot].clamp(min=0)  # an empty slot only wins at -inf; any id is safe to verify


@packed_head.register_fake
def _(hidden, packed, id_of, k):
    T = hidden.shape[0]
    return hidden.new_empty(T, k, dtype=torch.float32), id_of.new_empty(T, k)


@_op("masked_topk")
def masked_topk(logits: torch.Tensor, id_of: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """packed_head's epilogue per request (the batched engine's draft head): logits [B, T, R] of each request's own
    rows, id_of [B, R] (-1 = empty slot) -> (logp [B, T, k] fp32, ids [B, T, k]): log-softmax over the request's
    active slots, top-k, slots -> its token ids."""
    logits = logits.float().masked_fill(id_of[:, None] < 0, float("-inf"))
    logp, slot = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return logp, id_of[:, None].expand(-1, logits.shape[1], -1).gather(2, slot).clamp(min=0)


@masked_topk.register_fake
def _(logits, id_of, k):
    B, T, _ = logits.shape
    return logits.new_empty(B, T, k, dtype=torch.float32), id_of.new_empty(B, T, k)
