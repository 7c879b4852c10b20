"""Draft-vocabulary strategies: which LM-head rows the draft scores at each step.

Every strategy exposes the same packed view -- rows `packed` [R, d] and the token id of each row `id_of` [R]
(-1 = empty) -- so one op (`microspec::packed_head`) computes the draft head for all of them:
  full       the whole head (EAGLE-2), rows = W_head, ids = arange(V)
  static     FR-Spec: the K most frequent ids of a corpus, gathered once (EOS forced in, within the K)
  microspec-paper  the paper's window: Unique(Suffix(S, W_max - P)) over the stream, and the P pinned ids
             S = prompt ++ union of top-K_pre at every prompt position, then per round
                 unique(draft tree ids) ++ unique(top-K_ver of the target at the accepted positions)
             (and, with the runner's k_tree > 0, ++ unique(top-k_tree of the target at every verified tree node):
             issue 37, default for microspec only, so microspec-paper stays the paper's)
  microspec  the paper's window with two changes (OURS below switches both back to the paper's):
             - its unused slots filled: the window's ids, then the most frequent ids of a static ranking that
             are not in it, W_max ids in all; every id the stream brings in displaces the last fill id, never
             the reverse. Short prompts leave the paper's window mostly empty (211 of 3,072 ids on average on
             the H200's chat prompts, issue 23), while the draft head costs about the same at a few thousand
             rows (launch-bound on the H200), so the empty slots are coverage almost for free; the head scores
             2 x W_max rows.
             - a round appends only the ids not in the window already (the suffix is then W_max - P distinct
             ids, not W_max - P entries): a 60-node tree's round brings ~150 entries, most of them ids the
             window holds, which in the paper's suffix push the prompt's ids out within ~20 rounds
             (summarization on the CPU: coverage 96.4% -> 98.8%, benchmarks/cpu_fill_smollm2.md).
  ctx-only   S_init only, never updated (ablation)
  ext-only   rounds only: starts from the target's top-K_ver after prefill (ablation)
  naive      the microspec window scored by an indexed GEMM over W_head[ids] each call (no packing,
             no copy stream): the paper's "x Async" ablation
Every window holds at most W_max ids, whatever fills it (pinned, stream, fill): the paper's bound, and the
packed buffer's size; the pinned ids take their slots out of the stream's suffix (window_length).
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

from dataclasses import dataclass

import torch

from plugins import ops

from ..models.registry import UserError

METHODS = ("ar", "eagle", "frspec", "microspec", "microspec-paper", "ctx-only", "ext-only", "naive")
OURS = True  # whether `microspec` is our window (True: filled, distinct rounds) or the paper's, as `microspec-paper`


def fill_ranking(ranked_ids: torch.Tensor | None, vocab_size: int, n: int) -> torch.Tensor:
    """The fill's first n ids, most frequent first: FR-Spec's ranking when the engine has one, else the ids in
    id order: a byte-level BPE vocabulary lists its merges in the order it learned them, most frequent pair
    first, so low ids are the commonest pieces of the tokenizer's corpus (a weaker ranking than build-freq's;
    the special tokens at the start are harmless, as the draft scores them low)."""
    if ranked_ids is None:
        return torch.arange(min(n, vocab_size))
    return ranked_ids[:n].long()


def window_length(w_max: int, pinned: int) -> int:
    """The stream suffix a window keeps: W_max less its pinned ids, so that its ids (the suffix's distinct ones and
    the pinned) and the fill that tops it up never exceed W_max."""
    if w_max <= pinned:
        raise UserError(f"w_max {w_max} leaves no room beside the {pinned} pinned EOS ids: raise it")
    return w_max - pinned


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
        # the pinned ids count within the K, as the window's within its W_max
        pin = torch.tensor(sorted(set(pinned)), dtype=torch.long)
        ranked = ranked_ids.long()
        ids = torch.unique(torch.cat([pin, ranked[~torch.isin(ranked, pin)][:max(k - pin.numel(), 0)]]))
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
    those not in the window, most frequent first, as many as the window leaves free of its R = W_max
    slots (layers.window_fill: one launch per round on CUDA). The kept ids are a pure function of the window's
    membership (slot_of) and size, so a window that restarts (a request joins) restarts its fill too. Capturable in
    the CUDA graphs: no host work.
      ids     [F]    int64  the ranked ids
      rank_of [V+1]  int64  each id's position in ids, F if absent (the sentinel V too)"""

    def __init__(self, ids: torch.Tensor, vocab_size: int, device):
        self.ids = ids.to(device)
        self.F = F = self.ids.numel()
        self.rank_of = torch.full((vocab_size + 1,), F, dtype=torch.long, device=device)
        self.rank_of[self.ids] = torch.arange(F, device=device)


@dataclass(frozen=True)
class Window:
    """A MicroSpec window's settings; its state, one per batch slot, is vocab/batched.py's BatchWindow (the
    layout of plugins/ops.py). Its scored rows are [fill F | window R]: the fill's rows gathered once, the
    window's kept packed (gathered on a copy stream as ids enter), the fill ids not kept masked."""

    # name -> (prompt stream, round stream, packed buffer, fill, a round appends only ids not in the window)
    FLAGS = {"microspec": (True, True, True, OURS, OURS), "microspec-paper": (True, True, True, False, False),
             "ctx-only": (True, False, True, False, False), "ext-only": (False, True, True, False, False),
             "naive": (True, True, False, False, False)}

    name: str
    head_w: torch.Tensor  # [V, d] the draft head's rows (the target's LM head; EAGLE-3: its own, [V_draft, d])
    w_max: int
    pinned: list[int]  # ids always in the window (EOS; EAGLE-3: those of its draft vocabulary)
    ranked_ids: torch.Tensor | None = None  # the fill's ranking (fill_ranking; EAGLE-3: within its vocabulary)
    row_of: torch.Tensor | None = None  # EAGLE-3: target id -> head row [V + 1], -1 outside (row_index); None: same
    vocab_size: int | None = None  # EAGLE-3: the target's V (the window's ids are target ids)

    def __post_init__(self):
        window_length(self.w_max, len(set(self.pinned)))  # refused here, before the engine is made

    @property
    def V(self) -> int:
        """The window's id space: the target's ids."""
        return self.head_w.shape[0] if self.row_of is None else self.vocab_size

    @property
    def use_prompt(self) -> bool:
        return self.FLAGS[self.name][0]

    @property
    def use_rounds(self) -> bool:
        return self.FLAGS[self.name][1]

    @property
    def use_packed(self) -> bool:
        return self.FLAGS[self.name][2]

    @property
    def distinct(self) -> bool:
        return self.FLAGS[self.name][4]

    @property
    def fill_ids(self) -> torch.Tensor | None:
        """W_max ranked ids: enough to fill every slot the window leaves free, whichever it holds."""
        if not self.FLAGS[self.name][3]:
            return None
        return fill_ranking(self.ranked_ids, self.V, self.w_max)


def make_vocab(method: str, head: torch.Tensor, pinned: list[int], w_max: int = 3072,
               ranked_ids: torch.Tensor | None = None, static_k: int = 32768,
               head_ids: torch.Tensor | None = None, vocab_size: int | None = None):
    """head_ids / vocab_size: an EAGLE-3 head's own draft vocabulary, which is also frspec's static one."""
    if method == "eagle" or (method == "frspec" and head_ids is not None):
        return FullVocab(head, head_ids, vocab_size)
    if head_ids is not None:  # a window over an EAGLE-3 draft vocabulary: only its ids may enter (module docstring)
        row_of = row_index(head_ids, vocab_size)
        pinned = [p for p in pinned if row_of[p] >= 0]
        ranked = None if ranked_ids is None else ranked_ids.to(row_of.device).long()
        ranked = head_ids if ranked is None else ranked[row_of[ranked] >= 0]
        return Window(method, head, w_max, pinned, ranked, row_of, vocab_size)
    if method == "frspec":
        if ranked_ids is None:
            raise UserError("frspec needs token frequencies: run `microspec build-freq --engine DIR` first")
        return StaticVocab(head, ranked_ids, static_k, pinned)
    return Window(method, head, w_max, list(pinned), ranked_ids)
