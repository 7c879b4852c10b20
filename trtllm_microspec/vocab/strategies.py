"""Draft-vocabulary strategies: which LM-head rows the draft scores at each step.

Every strategy exposes the same packed view -- rows `packed` [R, d] and the token id of each row `id_of` [R]
(-1 = empty) -- so one op (`microspec::packed_head`) computes the draft head for all of them:
  full       the whole head (EAGLE-2), rows = W_head, ids = arange(V)
  static     FR-Spec: the K most frequent ids of a corpus, gathered once (EOS and specials forced in)
  microspec-paper  the paper's window: Unique(Suffix(S, W_max)) over the stream
             S = prompt ++ union of top-K_pre at every prompt position, then per round
                 unique(draft tree ids) ++ unique(top-K_ver of the target at the accepted positions)
  microspec  the paper's window with its unused slots filled (FILL below switches it back to the paper's): the
             window's ids, then the most frequent ids of a static ranking that are not in it, W_max + pinned
             ids in all; every id the stream brings in displaces the last fill id, never the reverse. Short prompts
             leave the paper's window mostly empty (211 of 3,072 ids on average on the H200's chat prompts,
             issue 23), while the draft head costs about the same at a few thousand rows (launch-bound on the
             H200), so the empty slots are coverage almost for free; the head scores 2 x (W_max + pinned) rows.
  ctx-only   S_init only, never updated (ablation)
  ext-only   rounds only: starts from the target's top-K_ver after prefill (ablation)
  naive      the microspec window scored by an indexed GEMM over W_head[ids] each call (no packing,
             no copy stream): the paper's "x Async" ablation
Choices the paper leaves open, made here: C_ver comes from the target logits at every accepted path position
(root .. last accepted node: the positions whose argmax were emitted); within one append the draft tree's ids
come first, in tree order (by draft score rank), then C_ver position by position; the prompt's top-K_pre union
is ordered by position, then by rank, first occurrence kept. EOS ids are pinned and never leave.
The fill's ranking is the engine's FR-Spec ranking (`microspec build-freq`, <engine>/token_freq.safetensors);
an engine without one ranks by token id (see fill_ranking).

An EAGLE-3 head brings its own LM head over its own draft vocabulary: `head` is then its rows [V_draft, d] and
`head_ids` the target id of each row (d2t). The strategies stay in target ids: full and static (frspec) are the
draft vocabulary itself, and the window holds target ids, gathers each one's row through `row_of` (t2d) and skips
the ids the draft vocabulary lacks, so they can never be proposed (the pinned EOS ids and the fill too).
"""
from __future__ import annotations

import torch

from plugins import ops

from ..models.registry import UserError

METHODS = ("ar", "eagle", "frspec", "microspec", "microspec-paper", "ctx-only", "ext-only", "naive")
FILL = True  # whether `microspec` is the filled window (True) or the paper's, as `microspec-paper` (False)


def fill_ranking(ranked_ids: torch.Tensor | None, vocab_size: int, n: int) -> torch.Tensor:
    """The fill's first n ids, most frequent first: FR-Spec's ranking when the engine has one, else the ids in
    id order: a byte-level BPE vocabulary lists its merges in the order it learned them, most frequent pair
    first, so low ids are the commonest pieces of the tokenizer's corpus (a weaker ranking than build-freq's;
    the special tokens at the start are harmless, as the draft scores them low)."""
    if ranked_ids is None:
        return torch.arange(min(n, vocab_size))
    return ranked_ids[:n].long()


def row_index(head_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The head row of each target id [V + 1], -1 for the ids without one (and the padding id -1 -> index V)."""
    row_of = torch.full((vocab_size + 1,), -1, dtype=torch.long, device=head_ids.device)
    row_of[head_ids] = torch.arange(head_ids.numel(), device=head_ids.device)
    return row_of


class FullVocab:
    def __init__(self, head: torch.Tensor, head_ids: torch.Tensor | None = None, vocab_size: int | None = None):
        """head_ids: the target id of each head row (an EAGLE-3 draft vocabulary), None: row i is id i."""
        self.packed = head
        self.id_of = torch.arange(head.shape[0], device=head.device) if head_ids is None else head_ids
        self._size = torch.tensor(head.shape[0], device=head.device)
        self.member = None
        if head_ids is not None:
            self.member = row_index(head_ids, vocab_size)[:vocab_size] >= 0

    def start(self, prompt_ids, prompt_topk, first_topk) -> None:
        pass

    def update(self, tree_ids, ver_ids) -> None:
        pass

    def join(self) -> None:
        pass

    def head(self, hidden: torch.Tensor, k: int):
        return ops.packed_head(hidden, self.packed, self.id_of, k)

    def size(self) -> torch.Tensor:
        return self._size

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(ids, dtype=torch.bool) if self.member is None else self.member[ids]


class StaticVocab(FullVocab):
    def __init__(self, head: torch.Tensor, ranked_ids: torch.Tensor, k: int, pinned: list[int]):
        ids = torch.unique(torch.cat([torch.tensor(pinned, dtype=torch.long), ranked_ids[:k].long()]))
        ids = ids.to(head.device)
        self.id_of = ids
        self.packed = head.index_select(0, ids)  # gathered once, contiguous
        self.member = torch.zeros(head.shape[0], dtype=torch.bool, device=head.device)
        self.member[ids] = True
        self._size = torch.tensor(ids.numel(), device=head.device)

    def contains(self, ids):
        return self.member[ids]


class Fill:
    """A window's fill: the static ranking's first F ids (F = R) and, per round, which of them are kept:
    those not in the window, most frequent first, as many as the window leaves free of its R = W_max + pinned
    slots (a cumsum over the not-in-window mask). The kept ids are a pure function of the window's membership
    (slot_of) and size, so a window that restarts (a request joins) restarts its fill too. All device tensor
    ops with static shapes: no host work, capturable in the CUDA graphs.
      ids     [F]    int64  the ranked ids
      rank_of [V+1]  int64  each id's position in ids, F if absent (the sentinel V too)"""

    def __init__(self, ids: torch.Tensor, vocab_size: int, device):
        self.ids = ids.to(device)
        self.F = F = self.ids.numel()
        self.rank_of = torch.full((vocab_size + 1,), F, dtype=torch.long, device=device)
        self.rank_of[self.ids] = torch.arange(F, device=device)

    def keep(self, in_window: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
        """in_window [..., F] (whether each ranked id is in its window), free [...] (slots the window leaves)
        -> the kept ranked ids [..., F], -1 where not kept."""
        out = ~in_window
        out &= torch.cumsum(out.long(), -1) <= free[..., None]
        return torch.where(out, self.ids, -1)


class WindowVocab:
    """The GPU-resident FIFO window over the candidate stream (state layout in plugins/ops.py), with an
    optional fill (class Fill). Its packed rows are [fill F | window R | sink]: the fill's rows are gathered
    once, and one packed_head over the first F + R rows scores both, the fill ids not kept masked as -1."""

    FLAGS = {"microspec": (True, True, True, FILL), "microspec-paper": (True, True, True, False),
             "ctx-only": (True, False, True, False), "ext-only": (False, True, True, False),
             "naive": (True, True, False, False)}  # name -> (prompt stream, round stream, packed buffer, fill)

    def __init__(self, name: str, head: torch.Tensor, w_max: int, pinned: list[int],
                 ranked_ids: torch.Tensor | None = None, head_ids: torch.Tensor | None = None,
                 vocab_size: int | None = None):
        """head_ids / vocab_size: an EAGLE-3 draft vocabulary (the module docstring); the window keeps target ids."""
        V, d = head.shape
        dev = head.device
        self.row_of = None  # target id -> head row (None: the same)
        if head_ids is not None:
            V = vocab_size
            self.row_of = row_index(head_ids, V)
            pinned = [p for p in pinned if self.row_of[p] >= 0]
            ranked = None if ranked_ids is None else ranked_ids.to(dev).long()
            ranked_ids = head_ids if ranked is None else ranked[self.row_of[ranked] >= 0]
        self.V = V
        use_prompt, use_rounds, packed, fill = self.FLAGS[name]
        self.head_w, self.w_max, self.pinned = head, w_max, torch.tensor(sorted(set(pinned)), device=dev,
                                                                          dtype=torch.long)
        self.use_prompt, self.use_rounds, self.use_packed = use_prompt, use_rounds, packed
        self.R = R = w_max + len(self.pinned)
        # R ranked ids: enough to fill every slot the window leaves free, whichever of them the window holds
        self.fill = Fill(fill_ranking(ranked_ids, V, R), V, dev) if fill else None
        F = self.fill.F if fill else 0
        self.ring = torch.full((w_max + 1,), -1, dtype=torch.long, device=dev)
        self.head_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.count = torch.zeros(V + 1, dtype=torch.int32, device=dev)
        self.slot_of = torch.full((V + 1,), -1, dtype=torch.long, device=dev)
        self.ids_all = torch.full((F + R + 1,), -1, dtype=torch.long, device=dev)
        self.first = torch.full((V + 1,), ops.BIG, dtype=torch.long, device=dev)
        self.rows_all = torch.zeros(F + R + 1, d, dtype=head.dtype, device=dev)  # last row: sink for padding
        # the window's own state (plugins/ops.py's id_of and its packed rows) is the part after the fill
        self.id_of_all, self.packed_all = self.ids_all[F:], self.rows_all[F:]
        self.fill_id_of = self.ids_all[:F]  # the kept fill ids (-1: not kept)
        if fill and packed:
            self.rows_all[:F] = head[self.rows(self.fill.ids)]
        self.packed, self.id_of = self.rows_all[:F + R], self.ids_all[:F + R]
        # the gather of newly active rows runs on its own stream, hidden behind the draft backbone
        self.copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and packed else None
        self.in_flight: tuple | None = None

    def reset(self) -> None:
        P = len(self.pinned)
        self.ring.fill_(-1)
        self.head_pos.zero_()
        self.count.zero_()
        self.slot_of.fill_(-1)
        self.ids_all.fill_(-1)
        slots = torch.arange(P, device=self.ring.device)
        self.count[self.pinned] = 1
        self.slot_of[self.pinned] = slots
        self.id_of_all[slots] = self.pinned
        if self.use_packed:
            ops.gather_rows(self.head_w, self.rows(self.pinned), self.packed_all, slots)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The head rows of target ids (of the draft vocabulary; padding's 0 reads any row)."""
        return ids if self.row_of is None else self.row_of[ids].clamp(min=0)

    def in_vocab(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (-1 = padding) with those the draft vocabulary lacks made padding too: they never enter the window."""
        return ids if self.row_of is None else torch.where(self.row_of[ids] >= 0, ids, -1)

    def _append(self, ids: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        rows, slots = ops.window_update(self.ring, self.head_pos, self.count, self.slot_of, self.id_of_all,
                                        self.first, self.in_vocab(ids))
        if not self.use_packed:
            return
        rows = self.rows(rows)
        if self.copy_stream is None:
            ops.gather_rows(self.head_w, rows, self.packed_all, slots)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream())  # the window state is ready
        with torch.cuda.stream(self.copy_stream):
            ops.gather_rows(self.head_w, rows, self.packed_all, slots)
        self.in_flight = (rows, slots)  # keep the inputs alive until the copy stream is done with them

    def join(self) -> None:
        """The compute stream waits for the gather: called after the draft forward it overlaps with."""
        if self.in_flight is not None:
            torch.cuda.current_stream().wait_stream(self.copy_stream)
            self.in_flight = None

    def _refill(self) -> None:
        """The fill of the window as it is now (on the compute stream: its rows need no gather)."""
        if self.fill is not None:
            free = self.R - (self.id_of_all[:self.R] >= 0).sum()
            self.fill_id_of.copy_(self.fill.keep(self.slot_of[self.fill.ids] >= 0, free))

    def start(self, prompt_ids: torch.Tensor, prompt_topk: torch.Tensor, first_topk: torch.Tensor) -> None:
        self.reset()
        if self.use_prompt:
            self._append(torch.cat([prompt_ids, ops.unique_first(prompt_topk, self.first)]))
        else:
            self._append(first_topk)
        self._refill()

    def update(self, tree_ids: torch.Tensor, ver_ids: torch.Tensor) -> None:
        if self.use_rounds:
            self._append(torch.cat([ops.unique_first(tree_ids, self.first), ops.unique_first(ver_ids, self.first)]))
            self._refill()

    def head(self, hidden: torch.Tensor, k: int):
        if not self.use_packed:  # naive: an indexed GEMM over scattered rows, every call
            return ops.packed_head(hidden, self.head_w[self.rows(self.id_of.clamp(min=0))], self.id_of, k)
        return ops.packed_head(hidden, self.packed, self.id_of, k)

    def size(self) -> torch.Tensor:
        return (self.id_of >= 0).sum()  # the window's ids and the kept fill ids

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        inside = self.slot_of[ids] >= 0
        if self.fill is None:
            return inside
        rank = self.fill.rank_of[ids]
        return inside | (self.fill_id_of[rank.clamp(max=self.fill.F - 1)] >= 0) & (rank < self.fill.F)


def make_vocab(method: str, head: torch.Tensor, pinned: list[int], w_max: int = 3072,
               ranked_ids: torch.Tensor | None = None, static_k: int = 32768,
               head_ids: torch.Tensor | None = None, vocab_size: int | None = None):
    """head_ids / vocab_size: an EAGLE-3 head's own draft vocabulary, which is also frspec's static one."""
    if method == "eagle" or (method == "frspec" and head_ids is not None):
        return FullVocab(head, head_ids, vocab_size)
    if head_ids is not None:
        return WindowVocab(method, head, w_max, pinned, ranked_ids, head_ids, vocab_size)
    if method == "frspec":
        if ranked_ids is None:
            raise UserError("frspec needs token frequencies: run `microspec build-freq --engine DIR` first")
        return StaticVocab(head, ranked_ids, static_k, pinned)
    return WindowVocab(method, head, w_max, pinned, ranked_ids)
