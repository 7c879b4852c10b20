"""The batched engine's draft vocabularies: one object for all batch slots, so a round's draft head, window update,
membership and size are each one set of tensor ops over the whole batch, with no Python loop over requests.

  SharedVocab  full (EAGLE-2) or static (FR-Spec) rows, the same for every request: one GEMM over all B x T rows.
  BatchWindow  the MicroSpec window of every batch slot: the window state of plugins/ops.py, one window per
               batch slot. Its update is ops.window_update_rows / ops.unique_first_rows: each
               request's row works on its own slot's window alone (one CUDA block per request; the torch reference
               through flat views, slot * row length + index), so no request ever reads or writes another's window
               and a round's update is a handful of kernels, not ~150. tests/test_batch_window.py checks it against
               one plain window per request (the same ops on a batch of one window). The fill (strategies.Fill) of each slot is kept
               beside it, [slots, F], and its rows are one [F, d] buffer that every slot shares.

`batch` below is always a LongTensor [B] of the running requests' batch slots (distinct), in batch order.
"""
from __future__ import annotations

import torch

from plugins import layers, ops

from .strategies import Fill, Window, window_length


def batch_vocab(vocab, slots: int):
    """make_vocab's vocabulary -> the batched engine's: shared rows, or a window per batch slot."""
    if isinstance(vocab, Window):
        fill = vocab.fill_ids
        return BatchWindow(vocab.head_w, vocab.w_max, vocab.pinned, slots,
                           None if fill is None else fill.to(vocab.head_w.device), vocab.use_prompt,
                           vocab.use_rounds, vocab.use_packed, vocab.row_of, vocab.V, vocab.distinct)
    return SharedVocab(vocab)


class SharedVocab:
    """A FullVocab or StaticVocab for the whole batch: no per-request state."""
    use_prompt = True  # (a window's flag: whether it starts from the prompt, else from the first token's top-K)
    takes_ids = False  # whether a round's update / a plain step's defer use the ids given (a window's do)

    def __init__(self, vocab):
        self.vocab = vocab

    def start(self, batch: torch.Tensor, prompt_ids: torch.Tensor | None, prompt_topk: torch.Tensor | None,
              first_topk: torch.Tensor | None = None) -> None:
        pass

    def update(self, batch: torch.Tensor, tree_ids: torch.Tensor, ver_ids: torch.Tensor) -> None:
        pass

    def defer(self, batch: torch.Tensor, ver_ids: torch.Tensor) -> None:
        pass  # (never called: takes_ids is False)

    def join(self) -> None:
        pass

    def head_for(self, batch: torch.Tensor, top: int):
        """The draft head of these requests: (hidden [B, T, d], k) -> (logp [B, T, k], ids [B, T, k])."""
        def head(hidden: torch.Tensor, k: int):
            B, T, d = hidden.shape
            logp, ids = self.vocab.head(hidden.reshape(B * T, d), k)
            return logp.view(B, T, k), ids.view(B, T, k)
        return head

    def head(self, hidden: torch.Tensor, batch: torch.Tensor, top: int, k: int):
        return self.head_for(batch, top)(hidden, k)

    def size(self, batch: torch.Tensor) -> torch.Tensor:
        return self.vocab.size().expand(batch.numel())

    def contains(self, batch: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab.contains(ids)


PENDING = 64  # BatchWindow: verified ids of plain steps kept per request until its next round


class BatchWindow:
    """The MicroSpec window (plugins/ops.py's state) of each of `slots` batch slots, reset when a request joins."""

    def __init__(self, head: torch.Tensor, w_max: int, pinned: list[int], slots: int,
                 fill_ids: torch.Tensor | None = None, use_prompt: bool = True, use_rounds: bool = True,
                 use_packed: bool = True, row_of: torch.Tensor | None = None, vocab_size: int | None = None,
                 distinct: bool = False):
        """fill_ids: the fill's ranked ids (strategies.fill_ranking), or None for the paper's window. The
        ablations (strategies.Window.FLAGS): use_prompt False starts a window from the first token's top-K_ver instead
        of the prompt stream (ext-only), use_rounds False never updates it (ctx-only), use_packed False scores
        the window by gathering its head rows at every call instead of keeping them packed (naive). row_of /
        vocab_size: an EAGLE-3 draft vocabulary, as strategies.Window's (pinned and fill ids already within it).
        distinct: a round's ids already in the window are not appended again (strategies: microspec's window)."""
        V, d = head.shape
        dev = head.device
        self.use_prompt, self.use_rounds, self.use_packed, self.distinct = use_prompt, use_rounds, use_packed, distinct
        self.row_of = row_of
        if row_of is not None:  # the window's ids are target ids; head rows are reached through row_of
            V = vocab_size
        self.head_w, self.pinned = head, torch.tensor(sorted(set(pinned)), dtype=torch.long, device=dev)
        # W_max bounds everything the draft may propose, the pinned ids included (the paper's bound, and the packed
        # buffer's size): the stream's suffix holds W_max - pinned ids, the fill tops the window up to R = W_max
        self.W, self.V, self.R = window_length(w_max, len(self.pinned)), V, w_max
        R = self.R
        # one sentinel column per slot absorbs padded writes, as in the single-request layout
        self.ring = torch.full((slots, self.W + 1), -1, dtype=torch.long, device=dev)
        self.head_pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.count = torch.zeros(slots, V + 1, dtype=torch.int32, device=dev)
        self.slot_of = torch.full((slots, V + 1), -1, dtype=torch.long, device=dev)
        self.id_of = torch.full((slots, R + 1), -1, dtype=torch.long, device=dev)
        self.first = torch.full((slots, V + 1), ops.BIG, dtype=torch.long, device=dev)
        # packed[s, R] is slot s's padding sink; gathers aim all padding at the last slot's, which the CUDA
        # gather_rows kernel skips
        self.packed = torch.zeros(slots, R + 1, d, dtype=head.dtype, device=dev)
        self.copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and use_packed else None
        self.in_flight: tuple | None = None
        self.fill = None if fill_ids is None else Fill(fill_ids, V, dev)
        F = 0 if self.fill is None else self.fill.F
        self.fill_rows = head[self.rows(self.fill.ids)] if F else None  # [F, d], gathered once, shared by every slot
        self.fill_id_of = torch.full((slots, F), -1, dtype=torch.long, device=dev)  # kept fill ids, -1: not kept
        # the verified ids of a request's plain steps (the speculation policy's), newest last, -1 = empty: they join
        # its stream at its next round's update (a window update costs ~160 small kernels, the plain step they would
        # be added to little more than the target's); the oldest drop out past PENDING
        self.pending = torch.full((slots, PENDING), -1, dtype=torch.long, device=dev)

    @property
    def takes_ids(self) -> bool:
        """Whether update / defer use their ids (ctx-only's window never changes after its prompt)."""
        return self.use_rounds

    def reset(self, batch: torch.Tensor) -> None:
        """The windows of batch hold their pinned ids alone, nothing of their last requests': a few index ops
        for the whole batch (the prompt pass starts every window whose prompt it completes at once)."""
        B, P = batch.numel(), len(self.pinned)
        for state, empty in ((self.ring, -1), (self.head_pos, 0), (self.count, 0), (self.slot_of, -1),
                             (self.id_of, -1), (self.fill_id_of, -1), (self.pending, -1)):
            state.index_fill_(0, batch, empty)
        at = (batch[:, None] * (self.V + 1) + self.pinned).flatten()  # each window's pinned ids, flat
        self.count.view(-1).index_fill_(0, at, 1)
        self.slot_of.view(-1).index_copy_(0, at, torch.arange(P, device=batch.device).repeat(B))
        self.id_of[:, :P].index_copy_(0, batch, self.pinned.expand(B, P))
        pinned = self.head_w[self.rows(self.pinned)]
        self.packed[:, :P].index_copy_(0, batch, pinned.expand(B, *pinned.shape))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The head rows of target ids (of the draft vocabulary; padding's 0 reads any row)."""
        return ids if self.row_of is None else self.row_of[ids].clamp(min=0)

    def start(self, batch: torch.Tensor, prompt_ids: torch.Tensor | None, prompt_topk: torch.Tensor | None,
              first_topk: torch.Tensor | None = None) -> None:
        """The requests join batch slots `batch` [B]: each window starts afresh from its prompt prompt_ids [B, n]
        and then its de-duplicated top-K_pre ids prompt_topk [B, m], both -1 padded (ext-only: from first_topk
        [B, k], the target's top-K_ver after the prompt). One batch of ops for all B (a row's padding is skipped,
        so each window is what it would be started alone); a single request is a batch of one."""
        self.reset(batch)
        if self.use_prompt:
            stream = torch.cat([prompt_ids, ops.unique_first_rows(prompt_topk, self.first, batch)], 1)
        else:
            stream = first_topk
        self._append(batch, stream)
        self._refill(batch)  # the fill of the new windows: nothing of the slots' last requests'

    def update(self, batch: torch.Tensor, tree_ids: torch.Tensor, ver_ids: torch.Tensor) -> None:
        """A round's stream of every request: the ids its plain steps deferred, then tree_ids [B, n], then
        ver_ids [B, m], each part de-duplicated per row."""
        if not self.use_rounds:
            return
        pending = self.pending.index_select(0, batch)
        new = torch.cat([ops.unique_first_rows(pending, self.first, batch),
                         ops.unique_first_rows(tree_ids, self.first, batch),
                         ops.unique_first_rows(ver_ids, self.first, batch)], 1)
        if self.distinct:  # only ids the window lacks (the fill's are not in it: they stay apart, as they were)
            new = torch.where(self._held(batch, new.clamp(min=0)), -1, new)
        self._append(batch, new)
        self.pending.index_fill_(0, batch, -1)
        self._refill(batch)

    def defer(self, batch: torch.Tensor, ver_ids: torch.Tensor) -> None:
        """Plain steps' verified ids [B, m] (-1 = none) of every request, oldest first, kept for its next round's
        update (the newest PENDING of them)."""
        if not self.use_rounds:
            return
        keep = torch.cat([self.pending.index_select(0, batch), ver_ids], 1)[:, -self.pending.shape[1]:]
        self.pending.index_copy_(0, batch, keep)

    def _refill(self, batch: torch.Tensor) -> None:
        """Each request's kept fill ids, from its window as it is now (padding rows repeat the padding slot: same
        values)."""
        if self.fill is None:
            return
        self.fill_id_of.index_copy_(0, batch, layers.window_fill(self.slot_of, self.id_of, self.fill.ids, batch, self.R))

    def _held(self, batch: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Whether each id of ids ([n], or [B, n] a row per window) is in window batch[b] (its stream or pinned ids,
        not its fill)."""
        return self.slot_of.view(-1)[batch[:, None] * (self.V + 1) + ids] >= 0

    def _append(self, batch: torch.Tensor, new_ids: torch.Tensor) -> None:
        """ops.window_update_rows for every request at once: row b of new_ids [B, n] (-1 = padding, skipped) joins
        the FIFO stream of slot batch[b]; then the gather of every newly active row, on the copy stream."""
        B, n = new_ids.shape
        if n == 0:
            return
        if self.row_of is not None:  # ids outside the draft vocabulary never enter the window (nor can be proposed)
            new_ids = torch.where(self.row_of[new_ids] >= 0, new_ids, -1)
        rows, slots = ops.window_update_rows(self.ring, self.head_pos, self.count, self.slot_of, self.id_of,
                                             self.first, new_ids, batch)
        if not self.use_packed:  # naive: the head gathers its rows at every call
            return
        packed = self.packed.view(-1, self.packed.shape[-1])
        rows = self.rows(rows.flatten())
        # each window's slot in the flat packed rows; padding (slot R) aims at the last one, which gather_rows skips
        dst = torch.where(slots < self.R, batch[:, None] * (self.R + 1) + slots, packed.shape[0] - 1).flatten()
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

    def head_for(self, batch: torch.Tensor, top: int):
        """ops.packed_head per request: (hidden [B, T, d], k) -> (logp [B, T, k] fp32, ids [B, T, k]) over each
        request's own packed rows. One bmm over slots 0 .. top-1 (top > every real slot of batch) reads the packed
        rows in place instead of copying B x R x d; a free slot below top costs one wasted GEMM of the batch.
        A padding row (slot >= top) goes to a spare row `top` of the bmm's input that nothing reads, and reads
        slot top-1's scores. The ids of each request's rows are gathered here once for the round's depth + 1 calls:
        each call is its GEMMs and one ops.masked_topk (on CUDA packed_head's fused log-softmax + top-k kernel)."""
        R = self.R
        # top 1: one row, the request in slot 0 (or padding, whose draws are dropped): it needs no scatter / gather
        one = top == 1 and batch.numel() == 1
        read = None if one else batch.clamp(max=top - 1)
        into = None if one else torch.where(batch < top, batch, top)
        if self.use_packed:
            rows = self.packed[:top, :R].transpose(1, 2)
        else:  # naive: an indexed GEMM over the window's scattered head rows, gathered at every call
            rows = None
        id_of = self.id_of[:1, :R] if one else self.id_of[:, :R].index_select(0, read)  # [B, R]
        if self.fill is not None:  # the shared fill rows in one GEMM over every row, their columns first as alone
            id_of = torch.cat([self.fill_id_of[:1] if one else self.fill_id_of.index_select(0, read), id_of], -1)
        id_of = id_of.contiguous()

        def head(hidden: torch.Tensor, k: int):
            B, T, d = hidden.shape
            # rows of free slots stay unwritten: a bmm row depends on its own input row only, and no real
            # request reads those (a padding row may, and its draws are dropped)
            h = hidden if one else hidden.new_empty(top + 1, T, d).index_copy_(0, into, hidden)[:top]
            w = rows if rows is not None else self.head_w[self.rows(self.id_of[:top, :R].clamp(min=0))].transpose(1, 2)
            logits = torch.bmm(h, w)
            if not one:
                logits = logits.index_select(0, read)
            if self.fill is not None:
                logits = torch.cat([torch.nn.functional.linear(hidden, self.fill_rows), logits], -1)
            return ops.masked_topk(logits, id_of, k)  # an empty slot only wins at -inf: any id is safe
        return head

    def head(self, hidden: torch.Tensor, batch: torch.Tensor, top: int, k: int):
        return self.head_for(batch, top)(hidden, k)

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
