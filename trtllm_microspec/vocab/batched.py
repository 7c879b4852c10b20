"""The batched engine's draft vocabularies: one object for all batch slots, so a round's draft head, window update,
membership and size are each one set of tensor ops over the whole batch, with no Python loop over requests.

  SharedVocab  full (EAGLE-2) or static (FR-Spec) rows, the same for every request: one GEMM over all B x T rows.
  BatchWindow  the MicroSpec window of every batch slot: WindowVocab's state (layout in plugins/ops.py) with a
               leading batch-slot dimension. Its update is ops.window_update / ops.unique_first with that dimension:
               each request indexes its own slot's rows through flat views (slot * row length + index), so no
               request ever reads or writes another's window. WindowVocab stays the single-request reference;
               tests/test_batch_window.py checks that the two agree exactly. The fill (strategies.Fill) of each
               slot is kept beside it, [slots, F], and its rows are one [F, d] buffer that every slot shares.

`batch` below is always a LongTensor [B] of the running requests' batch slots (distinct), in batch order.
"""
from __future__ import annotations

import torch

from plugins import ops

from .strategies import Fill, WindowVocab


def batch_vocab(vocab, slots: int):
    """The single-request vocabulary -> the batched engine's: shared rows, or a window per batch slot."""
    if isinstance(vocab, WindowVocab):
        if not (vocab.use_prompt and vocab.use_rounds and vocab.use_packed):
            raise ValueError("the batched engine runs the microspec windows only, not their ablations")
        return BatchWindow(vocab.head_w, vocab.w_max, vocab.pinned.tolist(), slots,
                           None if vocab.fill is None else vocab.fill.ids, vocab.row_of, vocab.V)
    return SharedVocab(vocab)


class SharedVocab:
    """A FullVocab or StaticVocab for the whole batch: no per-request state."""

    def __init__(self, vocab):
        self.vocab = vocab

    def start(self, slot: int, prompt_ids: torch.Tensor, prompt_topk: torch.Tensor) -> None:
        pass

    def update(self, batch: torch.Tensor, tree_ids: torch.Tensor, ver_ids: torch.Tensor) -> None:
        pass

    def join(self) -> None:
        pass

    def head(self, hidden: torch.Tensor, batch: torch.Tensor, top: int, k: int):
        B, T, d = hidden.shape
        logp, ids = self.vocab.head(hidden.reshape(B * T, d), k)
        return logp.view(B, T, k), ids.view(B, T, k)

    def size(self, batch: torch.Tensor) -> torch.Tensor:
        return self.vocab.size().expand(batch.numel())

    def contains(self, batch: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab.contains(ids)


def unique_first(ids: torch.Tensor, first: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """ops.unique_first per request: ids [B, n] (-1 = padding) -> each row with repeats after the row's first
    occurrence replaced by -1. first [slots, V+1]: each slot's own scratch, all = BIG between calls."""
    B, n = ids.shape
    flat, sentinel = first.view(-1), first.shape[1] - 1
    at = batch[:, None] * first.shape[1] + torch.where(ids >= 0, ids, sentinel)
    idx = torch.arange(n, device=ids.device).expand(B, n)
    flat.scatter_reduce_(0, at.flatten(), idx.flatten(), reduce="amin")
    keep = (flat[at] == idx) & (ids >= 0)
    flat.index_fill_(0, at.flatten(), ops.BIG)  # leave the scratch clean for the next call
    return torch.where(keep, ids, -1)


class BatchWindow:
    """The MicroSpec window (plugins/ops.py's state) of each of `slots` batch slots, reset when a request joins."""

    def __init__(self, head: torch.Tensor, w_max: int, pinned: list[int], slots: int,
                 fill_ids: torch.Tensor | None = None, row_of: torch.Tensor | None = None,
                 vocab_size: int | None = None):
        """fill_ids: the fill's ranked ids (strategies.fill_ranking), or None for the paper's window. row_of /
        vocab_size: an EAGLE-3 draft vocabulary, as WindowVocab's (pinned and fill ids already within it)."""
        V, d = head.shape
        dev = head.device
        self.row_of = row_of
        if row_of is not None:
            V = vocab_size
        self.head_w, self.pinned = head, torch.tensor(sorted(set(pinned)), dtype=torch.long, device=dev)
        self.W, self.V, self.R = w_max, V, w_max + len(self.pinned)
        R = self.R
        # one sentinel column per slot absorbs padded writes, as in the single-request layout
        self.ring = torch.full((slots, w_max + 1), -1, dtype=torch.long, device=dev)
        self.head_pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.count = torch.zeros(slots, V + 1, dtype=torch.int32, device=dev)
        self.slot_of = torch.full((slots, V + 1), -1, dtype=torch.long, device=dev)
        self.id_of = torch.full((slots, R + 1), -1, dtype=torch.long, device=dev)
        self.first = torch.full((slots, V + 1), ops.BIG, dtype=torch.long, device=dev)
        # packed[s, R] is slot s's padding sink; gathers aim all padding at the last slot's, which the CUDA
        # gather_rows kernel skips
        self.packed = torch.zeros(slots, R + 1, d, dtype=head.dtype, device=dev)
        self.copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.in_flight: tuple | None = None
        self.fill = None if fill_ids is None else Fill(fill_ids, V, dev)
        F = 0 if self.fill is None else self.fill.F
        self.fill_rows = head[self.rows(self.fill.ids)] if F else None  # [F, d], gathered once, shared by every slot
        self.fill_id_of = torch.full((slots, F), -1, dtype=torch.long, device=dev)  # kept fill ids, -1: not kept

    def reset(self, slot: int) -> None:
        P = len(self.pinned)
        self.ring[slot].fill_(-1)
        self.head_pos[slot] = 0
        self.count[slot].zero_()
        self.slot_of[slot].fill_(-1)
        self.id_of[slot].fill_(-1)
        self.fill_id_of[slot].fill_(-1)
        self.count[slot, self.pinned] = 1
        self.slot_of[slot, self.pinned] = torch.arange(P, device=self.pinned.device)
        self.id_of[slot, :P] = self.pinned
        self.packed[slot, :P] = self.head_w[self.rows(self.pinned)]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """WindowVocab.rows: the head rows of target ids."""
        return ids if self.row_of is None else self.row_of[ids].clamp(min=0)

    def start(self, slot: int, prompt_ids: torch.Tensor, prompt_topk: torch.Tensor) -> None:
        """A request joins batch slot `slot`: its window starts afresh from its prompt and top-K_pre ids."""
        self.reset(slot)
        batch = torch.tensor([slot], device=self.ring.device)
        self._append(batch, torch.cat([prompt_ids, unique_first(prompt_topk[None], self.first, batch)[0]])[None])
        self._refill(batch)  # the fill of the new window: nothing of the slot's last request's

    def update(self, batch: torch.Tensor, tree_ids: torch.Tensor, ver_ids: torch.Tensor) -> None:
        """A round's stream of every request: tree_ids [B, n] then ver_ids [B, m], each de-duplicated per row."""
        self._append(batch, torch.cat([unique_first(tree_ids, self.first, batch),
                                       unique_first(ver_ids, self.first, batch)], 1))
        self._refill(batch)

    def _refill(self, batch: torch.Tensor) -> None:
        """WindowVocab._refill for every request at once (padding rows repeat the padding slot: same values)."""
        if self.fill is None:
            return
        in_window = self.slot_of.view(-1)[batch[:, None] * (self.V + 1) + self.fill.ids] >= 0
        free = self.R - (self.id_of[batch, :self.R] >= 0).sum(1)
        self.fill_id_of.index_copy_(0, batch, self.fill.keep(in_window, free))

    def _append(self, batch: torch.Tensor, new_ids: torch.Tensor) -> None:
        """ops.window_update for every request at once: row b of new_ids [B, n] (-1 = padding, skipped) joins
        the FIFO stream of slot batch[b]; then the gather of every newly active row, on the copy stream."""
        B, n = new_ids.shape
        if n == 0:
            return
        if self.row_of is not None:  # ids outside the draft vocabulary never enter the window (WindowVocab.in_vocab)
            new_ids = torch.where(self.row_of[new_ids] >= 0, new_ids, -1)
        W, V, R = self.W, self.V, self.R
        ring, count, slot_of, id_of = (t.view(-1) for t in (self.ring, self.count, self.slot_of, self.id_of))
        at_ring, at_v, at_r = (batch[:, None] * width for width in (W + 1, V + 1, R + 1))  # each slot's row
        valid = new_ids >= 0
        rank = torch.cumsum(valid.long(), 1) - 1
        m = rank[:, -1:] + 1
        keep = valid & (rank >= m - W)  # only the last W entries of one append can stay in the window
        pos = at_ring + torch.where(keep, (self.head_pos[batch, None] + rank) % W, W)
        evicted = torch.where(keep, ring[pos], -1)  # the entry this one overwrites (-1 while the ring is filling)
        added = torch.where(keep, new_ids, -1)
        count.index_add_(0, (at_v + torch.where(evicted >= 0, evicted, V)).flatten(),
                         torch.full((B * n,), -1, dtype=count.dtype, device=count.device))
        ring.index_copy_(0, pos.flatten(), added.flatten())
        count.index_add_(0, (at_v + torch.where(added >= 0, added, V)).flatten(),
                         torch.ones(B * n, dtype=count.dtype, device=count.device))
        self.count[:, V:].fill_(0)
        self.ring[:, W:].fill_(-1)
        self.head_pos.index_add_(0, batch, m[:, 0])

        touched = torch.cat([evicted, added], 1)
        at = at_v + torch.where(touched >= 0, touched, V)
        # free the slots of ids that left the window (idempotent, so repeats need no de-duplication)
        gone = (touched >= 0) & (count[at] == 0) & (slot_of[at] >= 0)
        id_of.index_fill_(0, (at_r + torch.where(gone, slot_of[at], R)).flatten(), -1)
        slot_of.index_fill_(0, torch.where(gone, at, at_v + V).flatten(), -1)
        # give each id that entered the window (counted once) the request's next free slot, in order of appearance
        entered = (touched >= 0) & (count[at] > 0) & (slot_of[at] < 0)
        fresh = unique_first(torch.where(entered, touched, -1), self.first, batch)
        is_new = fresh >= 0
        free = self.id_of[batch, :R] < 0
        free_rank = torch.cumsum(free.long(), 1) - 1
        slot_by_rank = torch.full((B, R + 1), R, dtype=torch.long, device=ring.device)
        slot_by_rank.scatter_(1, torch.where(free, free_rank, R), torch.arange(R, device=ring.device).expand(B, R))
        slot_by_rank[:, R:].fill_(R)
        new_rank = torch.cumsum(is_new.long(), 1) - 1
        slots = torch.where(is_new, slot_by_rank.gather(1, new_rank.clamp(0, R)), R)
        ids = torch.where(is_new, fresh, V)
        slot_of.index_copy_(0, (at_v + ids).flatten(), slots.flatten())
        id_of.index_copy_(0, (at_r + slots).flatten(), ids.flatten())
        self.slot_of[:, V:].fill_(-1)
        self.id_of[:, R:].fill_(-1)

        packed = self.packed.view(-1, self.packed.shape[-1])
        rows = self.rows(torch.where(is_new, fresh, 0).flatten())
        dst = torch.where(is_new, at_r + slots, packed.shape[0] - 1).flatten()
        if self.copy_stream is None:
            ops.gather_rows(self.head_w, rows, packed, dst)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream())  # the window state is ready
        with torch.cuda.stream(self.copy_stream):
            ops.gather_rows(self.head_w, rows, packed, dst)
        self.in_flight = (rows, dst)  # keep the inputs alive until the copy stream is done with them

    def join(self) -> None:
        """The compute stream waits for the gather: called after the draft forward it overlaps with."""
        if self.in_flight is not None:
            torch.cuda.current_stream().wait_stream(self.copy_stream)
            self.in_flight = None

    def head(self, hidden: torch.Tensor, batch: torch.Tensor, top: int, k: int):
        """ops.packed_head per request: hidden [B, T, d] -> (logp [B, T, k] fp32, ids [B, T, k]) over each
        request's own packed rows. One bmm over slots 0 .. top-1 (top > every real slot of batch) reads the packed
        rows in place instead of copying B x R x d; a free slot below top costs one wasted GEMM of the batch.
        A padding row (slot >= top) reads slot top-1's rows and adds nothing to its input (an exact + 0)."""
        B, T, d = hidden.shape
        R = self.R
        read = batch.clamp(max=top - 1)
        h = hidden.new_zeros(top, T, d).index_add_(0, read, torch.where((batch < top)[:, None, None], hidden, 0))
        logits = torch.bmm(h, self.packed[:top, :R].transpose(1, 2)).index_select(0, read)
        id_of = self.id_of[read, None, :R]
        if self.fill is not None:  # the shared fill rows in one GEMM over every row, their columns first as alone
            logits = torch.cat([torch.nn.functional.linear(hidden, self.fill_rows), logits], -1)
            id_of = torch.cat([self.fill_id_of[read, None], id_of], -1)
        logits = logits.float().masked_fill(id_of < 0, float("-inf"))
        logp, col = torch.log_softmax(logits, -1).topk(k, dim=-1)
        return logp, id_of.expand(B, T, -1).gather(2, col).clamp(min=0)  # an empty slot only wins at -inf

    def size(self, batch: torch.Tensor) -> torch.Tensor:
        """The window's ids and the kept fill ids of each request."""
        return (self.id_of[batch, :self.R] >= 0).sum(1) + (self.fill_id_of[batch] >= 0).sum(1)

    def contains(self, batch: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, n] (>= 0) -> whether each is in its own request's window or its kept fill."""
        inside = self.slot_of.view(-1)[batch[:, None] * (self.V + 1) + ids] >= 0
        if self.fill is None:
            return inside
        F, rank = self.fill.F, self.fill.rank_of[ids]
        return inside | (self.fill_id_of.view(-1)[batch[:, None] * F + rank.clamp(max=F - 1)] >= 0) & (rank < F)
