"""Draft-vocabulary strategies: which LM-head rows the draft scores at each step.

Every strategy exposes the same packed view -- rows `packed` [R, d] and the token id of each row `id_of` [R]
(-1 = empty) -- so one op (`microspec::packed_head`) computes the draft head for all of them:
  full       the whole head (EAGLE-2), rows = W_head, ids = arange(V)
  static     FR-Spec: the K most frequent ids of a corpus, gathered once (EOS and specials forced in)
  microspec  the paper's window: Unique(Suffix(S, W_max)) over the stream
             S = prompt ++ union of top-K_pre at every prompt position, then per round
                 unique(draft tree ids) ++ unique(top-K_ver of the target at the accepted positions)
  ctx-only   S_init only, never updated (ablation)
  ext-only   rounds only: starts from the target's top-K_ver after prefill (ablation)
  naive      the microspec window scored by an indexed GEMM over W_head[ids] each call (no packing,
             no copy stream): the paper's "x Async" ablation
Choices the paper leaves open, made here: C_ver comes from the target logits at every accepted path position
(root .. last accepted node: the positions whose argmax were emitted); within one append the draft tree's ids
come first, in tree order (by draft score rank), then C_ver position by position; the prompt's top-K_pre union
is ordered by position, then by rank, first occurrence kept. EOS ids are pinned and never leave.
"""
from __future__ import annotations

import torch

from plugins import ops

from ..models.registry import UserError

METHODS = ("ar", "eagle", "frspec", "microspec", "ctx-only", "ext-only", "naive")


class FullVocab:
    def __init__(self, head: torch.Tensor):
        self.packed = head
        self.id_of = torch.arange(head.shape[0], device=head.device)
        self._size = torch.tensor(head.shape[0], device=head.device)

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
        return torch.ones_like(ids, dtype=torch.bool)


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


class WindowVocab:
    """The GPU-resident FIFO window over the candidate stream (state layout in plugins/ops.py)."""

    FLAGS = {"microspec": (True, True, True), "ctx-only": (True, False, True), "ext-only": (False, True, True),
             "naive": (True, True, False)}  # name -> (prompt stream, round stream, packed buffer)

    def __init__(self, name: str, head: torch.Tensor, w_max: int, pinned: list[int]):
        V, d = head.shape
        dev = head.device
        use_prompt, use_rounds, packed = self.FLAGS[name]
        self.head_w, self.w_max, self.pinned = head, w_max, torch.tensor(sorted(set(pinned)), device=dev)
        self.use_prompt, self.use_rounds, self.use_packed = use_prompt, use_rounds, packed
        R = w_max + len(self.pinned)
        self.ring = torch.full((w_max + 1,), -1, dtype=torch.long, device=dev)
        self.head_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.count = torch.zeros(V + 1, dtype=torch.int32, device=dev)
        self.slot_of = torch.full((V + 1,), -1, dtype=torch.long, device=dev)
        self.id_of_all = torch.full((R + 1,), -1, dtype=torch.long, device=dev)
        self.first = torch.full((V + 1,), ops.BIG, dtype=torch.long, device=dev)
        self.packed_all = torch.zeros(R + 1, d, dtype=head.dtype, device=dev)  # last row: sink for padding
        self.packed, self.id_of = self.packed_all[:R], self.id_of_all[:R]
        # the gather of newly active rows runs on its own stream, hidden behind the draft backbone
        self.copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and packed else None
        self.in_flight: tuple | None = None

    def reset(self) -> None:
        P = len(self.pinned)
        self.ring.fill_(-1)
        self.head_pos.zero_()
        self.count.zero_()
        self.slot_of.fill_(-1)
        self.id_of_all.fill_(-1)
        slots = torch.arange(P, device=self.ring.device)
        self.count[self.pinned] = 1
        self.slot_of[self.pinned] = slots
        self.id_of_all[slots] = self.pinned
        if self.use_packed:
            ops.gather_rows(self.head_w, self.pinned, self.packed_all, slots)

    def _append(self, ids: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        rows, slots = ops.window_update(self.ring, self.head_pos, self.count, self.slot_of, self.id_of_all,
                                        self.first, ids)
        if not self.use_packed:
            return
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

    def start(self, prompt_ids: torch.Tensor, prompt_topk: torch.Tensor, first_topk: torch.Tensor) -> None:
        self.reset()
        if self.use_prompt:
            self._append(torch.cat([prompt_ids, ops.unique_first(prompt_topk, self.first)]))
        else:
            self._append(first_topk)

    def update(self, tree_ids: torch.Tensor, ver_ids: torch.Tensor) -> None:
        if self.use_rounds:
            self._append(torch.cat([ops.unique_first(tree_ids, self.first), ops.unique_first(ver_ids, self.first)]))

    def head(self, hidden: torch.Tensor, k: int):
        if not self.use_packed:  # naive: an indexed GEMM over scattered rows, every call
            return ops.packed_head(hidden, self.head_w[self.id_of.clamp(min=0)], self.id_of, k)
        return ops.packed_head(hidden, self.packed, self.id_of, k)

    def size(self) -> torch.Tensor:
        return (self.id_of >= 0).sum()

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slot_of[ids] >= 0


def make_vocab(method: str, head: torch.Tensor, pinned: list[int], w_max: int = 3072,
               ranked_ids: torch.Tensor | None = None, static_k: int = 32768):
    if method == "eagle":
        return FullVocab(head)
    if method == "frspec":
        if ranked_ids is None:
            raise UserError("frspec needs token frequencies: run `microspec build-freq --engine DIR` first")
        return StaticVocab(head, ranked_ids, static_k, pinned)
    return WindowVocab(method, head, w_max, pinned)
