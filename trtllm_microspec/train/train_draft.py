"""`microspec train-draft`: train an EAGLE-1/2 (or, --arch eagle3, EAGLE-3) draft head for an engine on ShareGPT
conversations.

Recipe: the draft is fc + one decoder layer; the target's embedding and LM head are frozen and shared. Input at
position i = (embedding of token i+1, feature i) -> predicted feature i+1, where features are the target's
final-normed hidden states. Loss = smooth-L1(predicted, target feature i+1) + 0.1 x cross-entropy of
head(predicted) against the soft target distribution softmax(head(target feature i+1)), over the positions whose
input token i+1 belongs to an assistant turn (that is where the draft drafts at inference). The input features
get uniform noise, as EAGLE's training does.

Training-time test (HASS / EAGLE-3; --ttt-steps, 1 = EAGLE's single-step recipe, the default: on the H200 at equal
wall time, 3 and 5 unrolled steps flattened accuracy over depth but cost so many optimizer steps that depth-1
accuracy and acceptance fell, BENCHMARKS.md, Training): the draft is unrolled as the tree
drafts it. Step s of row i sits at position i+s, reads token i+s+1 (the data's) and the draft's own output of
step s-1 (step 0: the target's feature i), and attends to what a tree node at depth s sees: the committed rows
<= i of step 0 (causal within the conversation) and its own path, the steps 1..s of row i. It predicts feature
i+s+1 and the target's distribution there. Step s's loss is weighted 0.8^s (EAGLE-3): a node at depth s only
counts when its ancestors were accepted. Held-out accuracy is reported at depths 1..5 (the unrolled steps, top-1
draft argmax == target argmax) whatever --ttt-steps is, so runs with different settings compare.

Data: every ShareGPT conversation (or the first --conversations) rendered with the target's chat template (the
assistant turns are ChatGPT's, as in EAGLE), tokenised in parallel (tokenizers' encode_batch), and/or (--data DIR)
the target's own answers to ShareGPT's prompts from `microspec distill` (token ids as generated), each cut at
--max-len tokens and packed whole into rows of <= --max-len tokens (no padding): attention is block-diagonal causal
within a row and positions restart at 0 for each conversation. The target runs once per row; its features are
cached on the device (bf16 on CUDA; the rows past its memory in pinned host memory), once, and reused every
epoch; the target distribution is recomputed from them through the head, a chunk of rows at a time (V floats per
token would not fit). The last --heldout fraction of the conversations is held out (of the distilled ones when
there are any, or of --heldout-data's).

Token loss (--loss): full = the soft CE over the whole vocabulary (the reference; SoftCE never holds more than one
chunk of [rows, V] logits); fused = the same loss with its softmax part in one Triton kernel over bf16 logits
(fused_ce.py: no fp32 [rows, V] tensor, ~half the memory traffic); pruned = the soft CE over the --loss-vocab ids
most frequent in the training answers, both distributions renormalised over them (loss_head: ~k/V of the loss's
cost, which at V = 152k is ~80% of a step).

--arch eagle3 trains an EAGLE-3 head (speculative/eagle3.py) on the same data, rows, schedule and token loss: its input
is fc over the target's three tapped layers (cached beside the final feature), there is no feature regression
(the token loss alone, weight 1), --ttt-steps defaults to 3 (its later steps read its own output, which only the
unrolled steps train), and its draft vocabulary is the --loss-vocab ids most frequent in the training answers
(frequent_ids, EOS included). Its LM head starts as the target's rows of those ids and is trained with the rest
(SafeAILab's traineagle3 and SpecForge train the draft's lm_head, from a random init; speculators freezes it at
the target's rows): the loss is the soft CE of its distribution against the target's renormalised over those ids
(the target's rows, frozen, give the latter).

Schedule: linear warm-up over 5% of the steps, then cosine to 0, planned for --epochs. With --time-limit (the clock
counts the whole command: distilling, tokenising, caching, the held-out evaluation) the data is planned from rates
measured on the first training rows (caching them, then a few forward + backward passes): all rows when caching
them and training --epochs epochs fits the time left, else the rows that do, distilled rows first (plan_rows),
re-planned from the caching rate of the planned rows; then the schedule takes every step that fits before the
limit at the measured step time (more epochs when there is time), re-fitted REFITS times over the run, so the
cosine ends when time does (a hard stop still applies). A checkpoint (fp32 weights + optimizer + plan) is written
to <out>/checkpoint.pt every --save-every steps (0: never); --resume continues from it, and the data order depends
only on --seed and the step, so a resumed run follows the uninterrupted one. --eval then measures the head's
acceptance length on --eval-questions questions of each Spec-Bench category and HumanEval.

One command (the recipe): --distill-time N runs `microspec distill` for N seconds into --data (default
<out>/distilled), then the training on it, both under one --time-limit; with --time-limit and no --data, N
defaults to a third of the limit (DISTILL_SHARE) and ShareGPT is mixed in: `train-draft --engine E --out D
--time-limit 900` is the recipe.
"""
from __future__ import annotations

import functools
import gc
import json
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import perf_counter

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from plugins import layers

from ..models.model import KVCache, Span, Transformer
from ..models.registry import UserError, check_out_dir, need
from ..models.tokenizer import Tokenizer
from ..speculative.eagle import EagleDraft, _target_record, draft_config, save_draft
from ..speculative.eagle3 import Eagle3Draft, default_taps, draft3_config, save_draft3
from ..vocab.frequency import FREQ_FILE, save_ranking

CE_WEIGHT = 0.1  # EAGLE's weight of the token loss against the feature loss
NOISE = 0.1  # EAGLE's uniform noise on the input features: U(-NOISE, NOISE)
STEP_DECAY = 0.8  # EAGLE-3's loss weight per unrolled step
EVAL_DEPTHS = 5  # the default tree's depth: held-out accuracy at depths 1..5
CE_CHUNK = 1 << 26  # logits per chunk of the token loss: a [rows, V] fp32 tensor is 256 MB at most
TOKENIZE_CHUNK = 1024  # conversations per encode_batch call (one progress update each)
PROBE_STEPS = 10  # steps timed (after the first) to fit the schedule to --time-limit
PROBE_ROWS = 4  # training rows timed (caching, then forward + backward; after one warm-up row) to plan the data
REFITS = 20  # under --time-limit the schedule is re-fitted to the measured step time this many times over the run
CACHE_SLACK = 1.25  # caching may take this much longer than planned before it stops (the rest is left out)
LOSSES = ("full", "pruned", "fused")
FEATURE_RESERVE = 16 << 30  # bytes of device memory left free by the cached features: the training step's own
# rows the device cannot hold go to pinned host memory, copied back for each step that reads them: a 4,096-token
# EAGLE-3 row is ~50 MB, ~1 ms at PCIe's ~50 GB/s against the ~37 ms its training takes at the 111k tok/s measured
# (the copy's own time not measured yet). On the H200 the 900 s recipe wanted 4,354 rows and the device held 2,394
# (BENCHMARKS.md, Training)
HOST_RESERVE = 16 << 30  # bytes of host memory the host's share of the features leaves to the process and system
# bytes of a pinned host allocation, made as the rows come (not all at once before the first): torch's pinned
# allocator rounds each allocation up to a power of two, so one of 2^31 bytes holds its rows with less than a row
# unused (a row's tensors share it: each of its own would be rounded apart)
HOST_CHUNK_BYTES = 1 << 31
DISTILL_SHARE = 1 / 3  # the recipe (--time-limit, no --data): this share of the time limit goes to distilling
EVAL_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "code")
EVAL_METHODS = ("eagle", "microspec")
ARCHS = ("eagle2", "eagle3")
EAGLE3_TTT = 3  # --arch eagle3's default --ttt-steps: its later draft steps read its own output, trained only so
CHECKPOINT = "checkpoint.pt"


@dataclass
class Pack:
    """One packed row of whole conversations."""
    tokens: torch.Tensor  # [T] target input tokens
    positions: torch.Tensor  # [T] restart at 0 for each conversation
    doc: torch.Tensor  # [T] which conversation of the row each token belongs to
    assistant: torch.Tensor  # [T] bool: the token is in an assistant turn
    n: int  # valid(0).sum(): the row's positions with a depth-1 loss
    real: int  # tokens of conversations (the rest is padding)
    feats: torch.Tensor | None = None  # [T, d] target features
    aux: torch.Tensor | None = None  # [T, 3 d] EAGLE-3: the target's three tapped layers (the draft's input)
    sel: dict = field(default_factory=dict, repr=False)  # step -> valid(step).nonzero(), kept: nonzero syncs

    def on(self, dev: torch.device) -> "Pack":
        """This row with its features on dev: a row cached in host memory (FeatureStore) copied for one step,
        without waiting (pinned memory); its loss positions (sel) shared with it."""
        if self.feats is None or self.feats.device.type == dev.type:
            return self
        aux = None if self.aux is None else self.aux.to(dev, non_blocking=True)
        return replace(self, feats=self.feats.to(dev, non_blocking=True), aux=aux, sel=self.sel)

    def rows(self, s: int) -> torch.Tensor:
        """The indices of valid(s), computed once per row and step (a device sync each time otherwise)."""
        if s not in self.sel:
            self.sel[s] = self.valid(s).nonzero().squeeze(-1)
        return self.sel[s]

    @property
    def mask(self) -> torch.Tensor:
        """[T, T] bool: causal within each conversation (built on use: T^2 per row would not fit cached)."""
        return (self.doc[:, None] == self.doc[None, :]).tril()

    def valid(self, s: int) -> torch.Tensor:
        """[T] bool: row i has a loss at unrolled step s (its input token i+s+1 is in i's conversation and in an
        assistant turn; rows whose inputs cross into the next conversation still run, unread by valid rows)."""
        T = len(self.tokens)
        ahead = s + 1
        ok = torch.arange(T, device=self.doc.device) < T - ahead
        return ok & (self.doc.roll(-ahead) == self.doc) & self.assistant.roll(-ahead)


def tokenize(tok: Tokenizer, conversations: list[list[dict]], max_len: int,
             desc: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Render each conversation with the chat template -> (token ids, assistant-token mask), cut at max_len.
    A token is an assistant token if it starts inside an assistant message's content, or is the first token
    after it (the end-of-turn the draft must also predict). apply_chat appends a generation prompt; its tokens
    are outside every assistant span, so they carry no loss. encode_batch runs on all cores."""
    tok.fast.enable_truncation(max_len)  # this Tokenizer instance is ours; avoids offsets of 20k-token chats
    out = []
    bar = tqdm(total=len(conversations), desc=f"tokenise ({desc})", unit="conv", dynamic_ncols=True)
    tokens = 0
    for at in range(0, len(conversations), TOKENIZE_CHUNK):
        convs = conversations[at:at + TOKENIZE_CHUNK]
        texts = [tok.apply_chat(c) for c in convs]
        for conv, text, enc in zip(convs, texts, tok.fast.encode_batch(texts, add_special_tokens=False)):
            ids = np.asarray(enc.ids, dtype=np.int64)
            starts = np.asarray([s for s, _ in enc.offsets])
            assistant = np.zeros(len(ids), dtype=bool)
            cursor = 0
            for m in conv:
                body = m["content"].strip()  # some templates trim the content
                found = text.find(body, cursor) if body else -1
                if found < 0:
                    continue
                cursor = found + len(body)
                if m["role"] == "assistant":
                    a, b = np.searchsorted(starts, [found, cursor])
                    assistant[a:b + 1] = True
            if len(ids) > 1 and assistant[1:].any():
                out.append((ids, assistant))
                tokens += len(ids)
        bar.update(len(convs))
        bar.set_postfix(tok_per_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.3g}")
    _close(bar, tokens)
    return out


def pack(seqs: list[tuple[np.ndarray, np.ndarray]], max_len: int, device) -> list[Pack]:
    """Greedy in-order packing of whole (already truncated) conversations into rows of max_len tokens, the rest of
    a row padded as one more conversation with no loss: every row has the same shape, so the attention kernels
    (cuDNN's plans are built per shape) and the allocator see one shape, not one per row."""
    groups, cur, n = [], [], 0
    for s in seqs:
        if cur and n + len(s[0]) > max_len:
            groups.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += len(s[0])
    if cur:
        groups.append(cur)
    packs = []
    for g in groups:
        pad = max_len - sum(len(ids) for ids, _ in g)
        g = g + [(np.zeros(pad, dtype=np.int64), np.zeros(pad, dtype=bool))] if pad else g
        doc = torch.cat([torch.full((len(ids),), j) for j, (ids, _) in enumerate(g)])
        p = Pack(torch.from_numpy(np.concatenate([ids for ids, _ in g])),
                 torch.cat([torch.arange(len(ids)) for ids, _ in g]), doc,
                 torch.from_numpy(np.concatenate([a for _, a in g])), 0, max_len - pad)
        p.n = int(p.valid(0).sum())  # on the host: on the device it is a sync (and ~8 launches) per row
        p.tokens, p.positions, p.doc, p.assistant = (t.to(device) for t in (p.tokens, p.positions, p.doc,
                                                                             p.assistant))
        packs.append(p)
    return packs


def _close(bar: tqdm, tokens: int) -> None:
    """End a stage's progress bar with one line of its throughput (kept when logs drop the bars' updates)."""
    secs = bar.format_dict["elapsed"]
    bar.close()
    print(f"[train-draft] {bar.desc}: {tokens:,} tokens in {secs:.1f} s ({tokens / max(secs, 1e-9):,.0f} tok/s)",
          file=sys.stderr)


def _zero(device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.long, device=device)  # Span's committed length: nothing committed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # progress rates are launch rates until the queue is drained
        torch.cuda.synchronize(device)


class FeatureStore:
    """Memory for the cached features of up to `rows` rows. On the device: one allocation per tensor at the first
    row (thousands of row-sized tensors, each allocated between one forward's temporaries, left the caching
    allocator's segments in pieces: an EAGLE-3 recipe run on the H200 ran out of memory with 41 GiB reserved but
    unused). In host memory (`host`, pinned where CUDA runs): HOST_CHUNK_BYTES an allocation, made as rows come,
    its rows' tensors views of it. Rows past `rows` go to the store `then` (the host's after the device's), else
    keep their own tensors. The rows' features are views of its buffers: the memory goes back when the store and
    every row's features are dropped."""

    def __init__(self, rows: int, host: bool = False, then: "FeatureStore | None" = None):
        self.rows, self.used, self.host, self.then = rows, 0, host, then
        self.bufs: list[torch.Tensor] | None = None  # the allocation being filled: [its rows, *shape] per tensor
        self.at = 0  # its next row

    def keep(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.used >= self.rows:
            return ts if self.then is None else self.then.keep(*ts)
        if self.bufs is None or self.at == self.bufs[0].shape[0]:
            self.bufs, self.at = self._allocate(ts), 0
        self.used, self.at = self.used + 1, self.at + 1
        return tuple(b[self.at - 1].copy_(t, non_blocking=self.host) for b, t in zip(self.bufs, ts))

    def _allocate(self, ts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Buffers for the next rows: on the device every row of the store, one per tensor; in host memory the
        rows HOST_CHUNK_BYTES hold (one at least), in one pinned allocation."""
        left = self.rows - self.used
        if not self.host:
            return [torch.empty((left, *t.shape), dtype=t.dtype, device=t.device) for t in ts]
        n = min(left, max(1, HOST_CHUNK_BYTES // sum(t.nbytes for t in ts)))
        raw = torch.empty(n * sum(t.nbytes for t in ts), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        bufs, at = [], 0
        for t in ts:  # (each part's bytes a multiple of its element size: the views are aligned)
            bufs.append(raw[at:at + n * t.nbytes].view(t.dtype).view(n, *t.shape))
            at += n * t.nbytes
        return bufs


def feature_stores(packs: list[Pack], start: int, end: int, on_device: int) -> FeatureStore:
    """The stores of rows start .. end - 1 of the caching order that are not cached yet: rows before `on_device`
    (the rows the device's memory holds, counted from the first) on the device, the rest in host memory."""
    dev = sum(p.feats is None for p in packs[start:min(end, on_device)])
    host = sum(p.feats is None for p in packs[max(start, on_device):end])
    return FeatureStore(dev, then=FeatureStore(host, host=True) if host else None)


@torch.no_grad()  # not inference_mode: the cached features are later inputs of autograd graphs
def target_features(target: Transformer, packs: list[Pack], desc: str, until: float = math.inf,
                    store: FeatureStore | None = None) -> list[Pack]:
    """Caches each row's target features (into `store` when given), in order, until the clock passes `until` (one
    row at least); returns the rows cached. Rows already cached (the plan's probe rows) are kept as they are."""
    bar = tqdm(total=sum(p.real for p in packs), desc=f"target features ({desc})", unit="tok",
               unit_scale=True, dynamic_ncols=True)
    done = 0
    for p in packs:
        done += 1
        if p.feats is not None:
            continue
        T = len(p.tokens)
        slots = torch.arange(T, device=p.tokens.device)
        p.feats = target(p.tokens, p.positions, slots, Span(_zero(slots.device), p.mask, T))
        p.aux = target.tapped if target.taps else None
        if store is not None:
            p.feats, p.aux = store.keep(p.feats, p.aux) if p.aux is not None else (*store.keep(p.feats), None)
        bar.update(p.real)
        if perf_counter() > until:
            break
    _sync(packs[0].tokens.device)
    _close(bar, bar.n)
    if done < len(packs):
        print(f"[train-draft] --time-limit: caching ran past its plan, {done} of {len(packs)} rows cached; "
              f"training uses those", file=sys.stderr)
    return packs[:done]


def unroll(draft: EagleDraft, p: Pack, steps: int, noise: torch.Generator | None):
    """Yields the draft hidden [T, d] of each unrolled step (see the module docstring)."""
    T, dev = len(p.tokens), p.tokens.device
    x = p.feats if p.aux is None else p.aux  # EAGLE-3's step 0 reads the target's three layers (through fc)
    if noise is not None:
        x = x + (torch.rand(x.shape, generator=noise, device=dev) * 2 - 1).to(x.dtype) * NOISE
    rows = torch.arange(T, device=dev)
    new, eye = p.mask, torch.eye(T, dtype=torch.bool, device=dev)
    cache = None
    for s in range(steps):
        # a fresh, longer cache per step: writing into the one whose slices earlier steps' attention saved for
        # backward would invalidate them. Slots: step j's rows at j*T .. j*T+T-1.
        grown = KVCache(replace(draft.cfg, max_seq_len=(s + 1) * T), 1, _act_dtype(x), dev)
        if cache is not None:  # (a cache may hold a few more slots than asked: whole KV blocks)
            grown.k[:, :, :s * T] = cache.k[:, :, :s * T]
            grown.v[:, :, :s * T] = cache.v[:, :, :s * T]
            new = torch.cat([new, eye], dim=1)  # + this row's own slot of step s
        cache = grown
        x = draft.hidden(p.tokens.roll(-(s + 1)), x, p.positions + s, s * T + rows,
                         Span(_zero(dev), new, (s + 1) * T), cache=cache)
        yield x


def soft_ce_chunk(zq: torch.Tensor, zt: torch.Tensor):
    """fp32 draft logits zq and target logits zt [rows, V] -> (sum of the cross-entropy of softmax(zq) against
    softmax(zt), rows whose argmaxes agree, d loss / d zq). On CUDA it runs compiled (`_soft_ce_chunk`): the
    eager version makes ~10 passes over [rows, V] fp32 tensors, which cost more than the two GEMMs."""
    logq = zq.log_softmax(-1)
    p = zt.softmax(-1)
    return -(p * logq).sum(), (zq.argmax(-1) == zt.argmax(-1)).sum(), logq.exp() - p


@functools.cache
def _soft_ce_chunk(cuda: bool):
    return torch.compile(soft_ce_chunk, dynamic=True) if cuda else soft_ce_chunk


class SoftCE(torch.autograd.Function):
    """Sum over rows of the cross-entropy of softmax(h @ W^T) against softmax(want @ Wt^T) (want: the target's
    features of the same positions; Wt: want_weight, default W), and the number of rows whose argmaxes agree. Both
    logits are made a chunk of rows at a time and the gradients (h's, and W's when it is trained: EAGLE-3's own
    LM head) are computed in the forward, so no [rows, V] tensor outlives its chunk (a 16k-token batch at
    V = 152k would hold 10 GB of logits; recomputing the target's chunk is one GEMM)."""

    @staticmethod
    def forward(ctx, h, weight, want, want_weight=None):
        tw = weight if want_weight is None else want_weight
        rows = max(1, CE_CHUNK // weight.shape[0])
        chunk = _soft_ce_chunk(h.is_cuda)
        loss = torch.zeros((), device=h.device)
        correct = torch.zeros((), dtype=torch.long, device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        wgrad = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[1] else None
        for i in range(0, h.shape[0], rows):
            hq = h[i:i + rows].to(weight.dtype)
            zq = F.linear(hq, weight).float()
            zt = F.linear(want[i:i + rows].to(tw.dtype), tw).float()
            l, c, dz = chunk(zq, zt)
            loss, correct = loss + l, correct + c
            if grad is not None:
                grad[i:i + rows] = (dz.to(weight.dtype) @ weight).to(h.dtype)
            if wgrad is not None:
                wgrad += dz.t().to(weight.dtype) @ hq
        ctx.save_for_backward(grad, wgrad)
        ctx.wdtype = weight.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, g, _):
        grad, wgrad = ctx.saved_tensors
        return (None if grad is None else g * grad), (None if wgrad is None else (g * wgrad).to(ctx.wdtype)), None, None


def pack_losses(draft: EagleDraft, target: Transformer, p: Pack, steps: int, noise: torch.Generator | None,
                head: torch.Tensor | None = None, ce=SoftCE):
    """Per unrolled step: (feature loss, token loss, correct top-1, positions), summed over the step's valid rows.
    head: the LM-head rows the token loss is taken over (default: the whole vocabulary; see loss_head; EAGLE-3: the
    target's rows of its draft vocabulary, which give the target's distribution there; default: read from the
    target)."""
    if draft.version == 3:  # the target's distribution over the draft vocabulary: its rows of those ids
        want_head = target.head_weight[draft.head_ids] if head is None else head
    head = target.head_weight if head is None else head
    out = []
    for s, h in enumerate(unroll(draft, p, steps, noise)):
        sel = p.rows(s)
        nxt = sel + s + 1
        if draft.version == 3:  # no feature regression; the token loss through its own (trained) LM head
            ploss, correct = SoftCE.apply(draft.head_in(h[sel]), draft.lm_head.weight, p.feats[nxt], want_head)
            out.append((torch.zeros((), device=h.device), ploss, correct, len(sel)))
            continue
        vloss = F.smooth_l1_loss(h[sel].float(), p.feats[nxt].float(), reduction="none").mean(-1).sum()
        ploss, correct = ce.apply(h[sel], head, p.feats[nxt])
        out.append((vloss, ploss, correct, len(sel)))
    return out


def ce_weight(draft) -> float:
    """The token loss's weight: EAGLE's 0.1 beside the feature loss; EAGLE-3's token loss is the whole loss."""
    return 1.0 if draft.version == 3 else CE_WEIGHT


def _act_dtype(feats: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if feats.is_cuda else torch.float32  # the draft's activations under autocast


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(draft: EagleDraft, target: Transformer, packs: list[Pack], ce=SoftCE) -> dict:
    """Held-out depth-1 loss and top-1 accuracy at depths 1..EVAL_DEPTHS, over the whole vocabulary (ce: SoftCE,
    or FusedSoftCE, the same loss, for --loss fused: it then compiles nothing the training did not)."""
    draft.eval()
    sums = np.zeros((EVAL_DEPTHS, 4))  # feature loss, token loss, correct, positions
    for p in packs:
        # the torch path, as in training: the draft's fp32 weights under autocast are not the one-dtype
        # inference case the Triton kernels serve
        with _autocast(p.tokens.device), layers.path(False):
            sums += [[float(x) for x in step] for step in pack_losses(draft, target, p, EVAL_DEPTHS, None, None, ce)]
    draft.train()
    n = np.maximum(sums[:, 3], 1.0)
    return {"loss": float((sums[0, 0] + ce_weight(draft) * sums[0, 1]) / n[0]),
            "acc": [round(float(a), 4) for a in sums[:, 2] / n], "positions": int(sums[0, 3])}


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1009 + epoch)).tolist()


def pack_order(n: int, seed: int, step: int, per_step: int) -> list[int]:
    """Row indices of optimizer step `step`: a fresh permutation per epoch, from the seed and the epoch only."""
    return [_permutation(n, seed, g // n)[g % n] for g in range(step * per_step, (step + 1) * per_step)]


def lr_at(step: int, plan: int, lr: float) -> float:
    """Linear warm-up over 5% of the plan, then cosine to 0 at the plan's end."""
    warmup = max(1, plan // 20)
    return lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, plan) / plan))


def init_draft(engine_dir: Path, target: Transformer, device, seed: int, vocab_ids: torch.Tensor | None = None):
    """vocab_ids: an EAGLE-3 head over these target ids (its draft vocabulary), else an EAGLE-1/2 head. The EAGLE-3
    head's LM head starts as the target's rows of those ids (speculators' init: step 0 drafts through the target's
    own head) and is trained (SafeAILab's and SpecForge's recipes train it)."""
    torch.manual_seed(seed)
    from ..engine.loader import read_config
    c = read_config(engine_dir)
    if vocab_ids is None:
        draft = EagleDraft(draft_config(c), bias=False)  # Llama-3 EAGLE heads have no fc bias
    else:
        draft = Eagle3Draft(draft3_config(c), c.hidden_size, vocab_ids.numel(), default_taps(c.num_layers))
    for m in draft.modules():  # the Hugging Face init EAGLE's heads start from
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    if vocab_ids is not None:
        ids = vocab_ids.cpu()
        draft.d2t.copy_(ids - torch.arange(ids.numel()))
        draft.lm_head.weight.data.copy_(target.head_weight[vocab_ids.to(target.head_weight.device)].cpu().float())
    draft.setup(target, torch.float32, device)  # fp32 master weights; bf16 compute under autocast on CUDA
    draft.requires_grad_(True).train()
    return draft


def _feature_memory(dev: torch.device) -> int | None:
    """Bytes of device memory the cached features may take: what is free less FEATURE_RESERVE (the training
    step's own, beyond what the allocator already holds from the probe). None off CUDA: host memory is not sized."""
    if dev.type != "cuda":
        return None
    return torch.cuda.mem_get_info(dev)[0] - FEATURE_RESERVE


def _host_memory() -> int:
    """Bytes of host memory the features the device cannot hold may take: what the system has available less
    HOST_RESERVE (0 where /proc/meminfo cannot say)."""
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0
    return max(0, kb * 1024 - HOST_RESERVE)


def _cache_timed(target: Transformer, packs: list[Pack], desc: str) -> float:
    """Caches the rows' features; returns the caching rate (tokens/s) measured after the first row. The plan
    times the first training rows, not the held-out ones: those are few and the last is mostly padding (on the
    H200 they cached at 21k tok/s, the training rows at 110k), and a row costs its padded length."""
    t = perf_counter()
    target_features(target, packs[:1], desc)
    if len(packs) > 1:
        t = perf_counter()
        target_features(target, packs[1:], desc)
    return sum(p.real for p in packs[1:] or packs) / max(perf_counter() - t, 1e-9)


def answer_counts(seqs: list[tuple[np.ndarray, np.ndarray]], V: int) -> np.ndarray:
    """How often each id is an assistant token of the training data [V]."""
    return np.bincount(np.concatenate([ids[m] for ids, m in seqs]), minlength=V)[:V]


def frequent_ids(target: Transformer, seqs: list[tuple[np.ndarray, np.ndarray]], k: int):
    """The k ids most frequent as assistant tokens of the training data, EOS always among them, in id order; and
    the share of the training positions whose next token they hold."""
    V = target.head_weight.shape[0]
    counts = answer_counts(seqs, V)
    rank = counts.astype(np.float64)
    rank[[e for e in target.cfg.eos_ids if e < V]] = np.inf  # the end of an answer is always predictable
    ids = np.sort(np.argsort(-rank, kind="stable")[:k])
    return torch.from_numpy(ids), float(counts[ids].sum()) / max(1, int(counts.sum()))


def loss_head(target: Transformer, seqs: list[tuple[np.ndarray, np.ndarray]], loss: str, k: int):
    """The LM-head rows the training token loss is taken over, and the share of the training positions whose
    next token they hold. full: the whole vocabulary (the reference). pruned: the k ids most frequent as assistant
    tokens of the training data (EOS included): the soft CE is then between the draft's and the target's
    distributions both renormalised over those ids, at k/V of the loss's cost (the logits, the softmax and the
    input gradient are ~80% of a step at V = 152k). The draft still outputs a feature through the frozen full head;
    what the pruned loss no longer pushes down is mass on the rare ids. A lumped 'rest' term would need the
    draft's full-vocabulary normaliser, the very cost being cut. Held-out evaluation always uses the full loss."""
    V = target.head_weight.shape[0]
    if loss != "pruned" or k >= V:
        return None, 1.0
    ids, share = frequent_ids(target, seqs, k)
    return target.head_weight[ids.to(target.head_weight.device)].contiguous(), share


def plan_rows(row_tokens: list[int], left: float, cache_rate: float, train_rate: float, epochs: float) -> int:
    """Rows (a prefix of the caching order) that can be cached and then trained for `epochs` epochs in `left`
    seconds: t tokens cost t / cache_rate + epochs * t / train_rate. At least one row; all when they fit."""
    budget = max(0.0, left) / (1.0 / cache_rate + epochs / train_rate)
    cum = np.cumsum(row_tokens)
    return max(1, int(np.searchsorted(cum, budget, side="right")))


def train_rate(draft: EagleDraft, target: Transformer, packs: list[Pack], steps: int, head, ce=SoftCE) -> float:
    """Training tokens/s: forward + backward (the gradients are dropped) on a few cached training rows, after one
    warm-up row (compilation, cuDNN plans)."""
    rows = [packs[i % len(packs)] for i in range(PROBE_ROWS + 1)]
    dev = rows[0].tokens.device
    t = 0.0
    for j, p in enumerate(rows):
        if j == 1:
            _sync(dev)
            t = perf_counter()
        with _autocast(dev):
            losses = pack_losses(draft, target, p, steps, None, head, ce)
        sum(vl + ce_weight(draft) * pl for vl, pl, _, _ in losses).backward()
    _sync(dev)
    draft.zero_grad(set_to_none=True)
    return sum(p.real for p in rows[1:]) / max(perf_counter() - t, 1e-9)


def _cut(seqs, max_len: int):
    """Distilled conversations cut at max_len, as tokenize cuts ShareGPT's; those left with no loss dropped."""
    out = [(ids[:max_len], m[:max_len]) for ids, m in seqs]
    return [(ids, m) for ids, m in out if len(ids) > 1 and m[1:].any()]


def _shuffled(packs: list[Pack], seed: int) -> list[Pack]:
    return [packs[i] for i in torch.randperm(len(packs), generator=torch.Generator().manual_seed(seed)).tolist()]


def spec_eval(engine_dir: Path, draft_dir: Path, device: str | None, max_new_tokens: int,
              methods: tuple[str, ...] = EVAL_METHODS, questions: int = 1) -> tuple[dict, dict]:
    """Acceptance length (tokens per round, bonus included) of the head on the first turn of the first `questions`
    questions of each EVAL_CATEGORIES category, per method (default tree, every step a round of it: spec_policy
    fixed, so the number is the head's, not the speculation policy's choice of trees) -> ({method: overall},
    {method: {category: acceptance}}): where the head is weak (translation, say) shows per category."""
    from ..bench.specbench import data_dir, load_questions
    from ..llm import LLM

    questions = load_questions(data_dir(None), list(EVAL_CATEGORIES), questions)
    out, by_cat = {}, {}
    for method in methods:
        llm = LLM(engine_dir, method=method, draft=draft_dir, device=device, spec_policy="fixed")
        counts = {}  # category -> [rounds, tokens]
        for q in tqdm(questions, desc=f"acceptance ({method})", unit="prompt", dynamic_ncols=True):
            st = llm.generate(q["turns"][0], max_new_tokens, chat=True).stats
            c = counts.setdefault(q["category"], [0, 0])
            c[0], c[1] = c[0] + st["rounds"], c[1] + st["round_tokens"]
        rounds, tokens = sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())
        out[method] = round(tokens / rounds, 3) if rounds else None  # no round: no acceptance to report
        by_cat[method] = {k: round(t / r, 3) if r else None for k, (r, t) in counts.items()}
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # its KV pool back to the device: the next engine sizes its pool from what is free
    return out, by_cat


def training_data(engine_dir: Path, tok: Tokenizer, max_len: int, heldout: float, conversations: int | None,
                  data: list[list[dict]] | None, distilled, mix_sharegpt: bool, heldout_data):
    """-> (train sequences in priority order, how many come first (distilled), held-out sequences, description).
    Sources: ShareGPT (the default, or `data`), and/or a `microspec distill` directory. The held-out part is the last
    `heldout` fraction of the conversations of heldout_data (default: the distilled directory if any, else ShareGPT's);
    when it is a distilled directory, those conversations are left out of every training source (of ShareGPT's too,
    unless that directory's prompts were a --prompts file's), so arms with different data score on the same held-out text (the
    target's own answers)."""
    from ..data import sharegpt_conversations
    from .distill import FILE_SOURCE, load_distilled

    dist, m_dist = load_distilled(distilled, engine_dir) if distilled else ([], None)
    held_src = heldout_data or distilled
    if held_src:
        pool, m_held = (dist, m_dist) if held_src == distilled else load_distilled(held_src, engine_dir)
        sharegpt_held = not m_held["prompt_source"].startswith(FILE_SOURCE)  # its indices are ShareGPT's
        pool = sorted(pool, key=lambda c: c[0])
        n_held = max(1, round(heldout * len(pool)))
        if len(pool) <= n_held and held_src == distilled:
            raise UserError(f"need more than {n_held} distilled conversations to hold {n_held} out, got {len(pool)}")
        held_ix = {c for c, _, _ in pool[-n_held:]}
        held = _cut([(ids, m) for c, ids, m in pool[-n_held:]], max_len)
        dist = [(ids, m) for c, ids, m in sorted(dist, key=lambda c: c[0]) if c not in held_ix]
    first = _cut(dist, max_len)
    rest = []
    if not distilled or mix_sharegpt:
        convs = data if data is not None else sharegpt_conversations(conversations)
        if held_src:
            rest = tokenize(tok, [c for i, c in enumerate(convs) if not (sharegpt_held and i in held_ix)], max_len,
                            "train")
        else:
            n_held = max(1, round(heldout * len(convs)))
            if len(convs) <= n_held:
                raise UserError(f"need more than {n_held} conversations to hold {n_held} out, got {len(convs)}")
            rest = tokenize(tok, convs[:-n_held], max_len, "train")
            held = tokenize(tok, convs[-n_held:], max_len, "held-out")
    if not first and not rest:
        raise UserError(f"{distilled} leaves no training conversation once its held-out part is taken")
    if not held:
        raise UserError(f"the held-out conversations of {held_src or 'ShareGPT'} have no assistant tokens")
    what = " + ".join(w for w, n in (("distilled", len(first)), ("ShareGPT", len(rest))) if n)
    return first + rest, len(first), held, what


def train(engine: str | Path, out: str | Path, conversations: int | None = None, max_len: int = 4096,
          steps: int | None = None, epochs: float = 3.0, lr: float = 5e-4, batch_tokens: int = 32768,
          ttt_steps: int = 1, seed: int = 0, device: str | None = None, resume: bool = False,
          save_every: int = 200, heldout: float = 0.02, time_limit: float | None = None,
          eval_tokens: int = 0, data: list[list[dict]] | None = None, distilled: str | Path | None = None,
          mix_sharegpt: bool = False, heldout_data: str | Path | None = None, loss: str = "full",
          loss_vocab: int = 32768, eval_methods: tuple[str, ...] = EVAL_METHODS, eval_questions: int = 1,
          arch: str = "eagle2") -> dict:
    """Returns the run's record (also printed by the command). eval_tokens > 0: --eval with that many new tokens.
    Under time_limit the data is planned from measured rates: every row when caching it and training it for
    `epochs` epochs fits, else the rows that do (distilled rows first, then ShareGPT's, each in a seeded random
    order); the schedule then takes every step that fits the time left (more epochs when there is time)."""
    from ..engine.loader import load_target, pick_device, read_config
    from ..llm import resolve_engine

    t0 = perf_counter()
    if ttt_steps < 1:
        raise UserError("--ttt-steps must be at least 1")
    if arch not in ARCHS:
        raise UserError(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if loss not in LOSSES:
        raise UserError(f"unknown --loss {loss!r}; choose one of {', '.join(LOSSES)}")
    if arch == "eagle3" and loss == "fused":  # the kernel takes one head; EAGLE-3's loss has two (its, the target's)
        raise UserError("--loss fused is for EAGLE-2 heads: --arch eagle3 trains its own LM head with --loss pruned "
                        "or full")
    if loss_vocab < 1 or not 0 < epochs < math.inf:
        raise UserError(f"--loss-vocab and --epochs must be positive, got {loss_vocab} and {epochs}")
    for name, v, lo in (("--max-len", max_len, 2), ("--batch-tokens", batch_tokens, 1), ("--save-every", save_every, 0),
                        ("--steps", 1 if steps is None else steps, 1)):
        need(name, v, lo)  # (--max-len: a row needs an input and a next token)
    if not 0 < lr < math.inf:  # NaN fails these too
        raise UserError(f"--lr must be positive, got {lr}")
    if not 0 <= heldout < 1:
        raise UserError(f"--heldout must be a fraction in [0, 1), got {heldout}")
    if time_limit is not None and not 0 < time_limit < math.inf:
        raise UserError(f"--time-limit must be positive, got {time_limit}")
    check_out_dir(out)
    if mix_sharegpt and not distilled:
        raise UserError("--mix-sharegpt mixes ShareGPT into --data DIR: give --data")
    if eval_tokens:
        from ..bench.specbench import data_dir
        data_dir(None)  # no Spec-Bench data is an error now, not after the training
    engine_dir, out = resolve_engine(engine), Path(out)
    dev, dtype = pick_device(device)
    ce = SoftCE
    if loss == "fused":
        from .fused_ce import FusedSoftCE, available
        if not available(dev):
            raise UserError("--loss fused runs a Triton kernel: it needs a CUDA device (TRITON_INTERPRET=1 runs it "
                            "on the CPU, slowly)")
        ce = FusedSoftCE
    torch.manual_seed(seed)
    # a row must fit the target's KV cache, and its positions + the unrolled steps (training's and the held-out
    # evaluation's) the rope tables
    max_len = min(max_len, read_config(engine_dir).max_seq_len - max(EVAL_DEPTHS, ttt_steps))
    target, tok = load_target(engine_dir, dev, dtype, max_seq_len=max_len)
    if arch == "eagle3":  # every cached row keeps the three layers the head reads (Transformer.taps)
        target.taps = tuple(default_taps(target.cfg.num_layers))
    seqs, n_first, held, what = training_data(engine_dir, tok, max_len, heldout, conversations, data, distilled,
                                              mix_sharegpt, heldout_data)
    head, coverage = loss_head(target, seqs, loss, loss_vocab)
    # the answers' token ranking, saved beside the head: MicroSpec's fill ranks its free slots by it when the engine
    # has no build-freq ranking (else an EAGLE-3 head's fill would rank its draft vocabulary by id)
    counts = torch.from_numpy(answer_counts(seqs, target.cfg.vocab_size))
    vocab_ids = None
    if arch == "eagle3":  # its draft vocabulary: the --loss-vocab ids most frequent in the training answers
        V = target.cfg.vocab_size
        vocab_ids, coverage = frequent_ids(target, seqs, loss_vocab) if loss == "pruned" and loss_vocab < V \
            else (torch.arange(V), 1.0)
        head = None  # the loss is through its own LM head, against the target's rows of its ids (below)
    train_packs = _shuffled(pack(seqs[:n_first], max_len, dev), seed) + \
        _shuffled(pack(seqs[n_first:], max_len, dev), seed + 1)
    held_packs = pack(held, max_len, dev)
    del seqs
    _cache_timed(target, held_packs, "held-out")  # (also the caching's warm-up)

    per_step = max(1, batch_tokens // max_len)
    draft = init_draft(engine_dir, target, dev, seed, vocab_ids)
    if arch == "eagle3":  # the target's rows of the draft vocabulary: the target's distribution there (frozen)
        head = target.head_weight[draft.head_ids].contiguous()
    opt = torch.optim.AdamW([q for q in draft.parameters() if q.requires_grad], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = None
    if resume:
        ck = out / CHECKPOINT
        if not ck.exists():
            raise UserError(f"--resume: no checkpoint at {ck}")
        # on the host: load_state_dict copies it to the parameters' device; a device copy would stay referenced
        # for the whole run, and AdamW's `step` counters loaded onto CUDA (it keeps them on the host) make every
        # optimizer step read each one back (.item(), a sync per parameter)
        state = torch.load(ck, map_location="cpu", weights_only=True)
        keep = min(len(train_packs), int(state["key"]["rows"]))  # the rows the interrupted run planned
    elif time_limit is not None:
        probe = train_packs[:PROBE_ROWS + 1]  # the first rows of the caching order: cached in any plan
        cache_rate = _cache_timed(target, probe, "probe")
        rate = train_rate(draft, target, probe, ttt_steps, head, ce)
        left = t0 + time_limit - perf_counter()
        keep = plan_rows([p.real for p in train_packs], left, cache_rate, rate, epochs)
        print(f"[train-draft] plan: caching {cache_rate:,.0f} tok/s, training {rate:,.0f} tok/s, {left:.0f} s left: "
              f"{keep} of {len(train_packs)} rows ({what}), >= {epochs:g} epochs", file=sys.stderr)
        del probe  # (rows the plan leaves out drop their features with train_packs below)
    else:
        keep = len(train_packs)
    fits, on_device, store = len(train_packs), len(train_packs), None
    free = _feature_memory(dev)
    if free is not None:  # the features stay on the device as far as its memory holds them, then in host memory
        have = sum(p.feats is not None for p in train_packs)  # the probe rows, on the device already
        row = max_len * target.cfg.hidden_size * (1 + len(target.taps)) * dtype.itemsize  # (+ EAGLE-3's layers)
        on_device = have + max(0, free) // row
        host = _host_memory()
        fits = min(fits, on_device + host // row)
        if fits < keep:
            short = f"the features of {keep} rows of {max_len} tokens need {keep * row / 2 ** 30:.1f} GiB; " \
                    f"{max(0, free) / 2 ** 30:.1f} GiB of device memory is free beside {FEATURE_RESERVE >> 30} GiB " \
                    f"for the training step, and {host / 2 ** 30:.1f} GiB of host memory"
            if resume:  # its checkpoint was trained on exactly these rows
                raise UserError(f"--resume: {short}: resume on a machine with more free memory")
            if not fits:
                raise UserError(f"{short}: lower --max-len or free the device")
            print(f"[train-draft] device and host memory hold the features of {fits} of the {keep} planned rows",
                  file=sys.stderr)
            keep = fits
        if keep > on_device:
            print(f"[train-draft] the features of {keep - on_device} of the {keep} rows go to host memory (the "
                  f"device holds {on_device})", file=sys.stderr)
        # the planned rows exactly (the re-plan's rows get stores of their own): the rest of the device stays
        # free for the training step
        store = feature_stores(train_packs, 0, keep, on_device)
    planned = sum(p.real for p in train_packs[:keep] if p.feats is None)
    until = perf_counter() + CACHE_SLACK * planned / cache_rate if time_limit is not None and not resume else math.inf
    t_cache = perf_counter()
    cached = target_features(target, train_packs[:keep], "train", until, store)
    took = perf_counter() - t_cache
    if time_limit is not None and not resume and len(cached) == keep < fits and took >= 1.0:
        # the plan's caching rate was timed on a few rows: re-plan from the planned rows' own rate, and cache the
        # rows that now fit
        measured = planned / took
        left = t0 + time_limit - perf_counter() - epochs * sum(p.real for p in cached) / rate
        if measured > cache_rate and left > 0:
            more = plan_rows([p.real for p in train_packs[keep:fits]], left, measured, rate, epochs)
            extra = sum(p.real for p in train_packs[keep:keep + more])
            print(f"[train-draft] re-plan: caching ran at {measured:,.0f} tok/s: {more} more rows", file=sys.stderr)
            if store is not None:
                store = feature_stores(train_packs, keep, keep + more, on_device)
            cached += target_features(target, train_packs[keep:keep + more], "train",
                                      perf_counter() + CACHE_SLACK * extra / measured, store)
    train_packs, store = cached, None  # the rows' features hold the stores' memory, nothing else
    del cached

    total = steps or math.ceil(epochs * len(train_packs) / per_step)
    plan = total  # steps in the LR schedule; --time-limit may change it once measured
    key = {"engine": str(engine_dir.resolve()), "data": what, "distilled": str(distilled), "max_len": max_len,
           "seed": seed, "batch_tokens": batch_tokens, "ttt_steps": ttt_steps, "loss": loss,
           "loss_vocab": loss_vocab, "rows": len(train_packs),  # the rows cached: --resume caches the same
           **({"arch": arch, "lm_head": "trained"} if arch != "eagle2" else {})}  # (older eagle3 runs froze it)
    start = 0
    if state is not None:
        if state["key"] != key:
            raise UserError(f"--resume: {out / CHECKPOINT} was made with other settings {state['key']}")
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        start, plan = state["step"], state["plan"]
    t_eval = perf_counter()
    before = evaluate(draft, target, held_packs, ce)
    # the held-out evaluation after training costs what this one did: the training stops early by that much, so
    # the command (evaluation and saving included) ends by --time-limit
    deadline = t0 + time_limit - (perf_counter() - t_eval) if time_limit is not None else math.inf
    done, t_probe, seen, fitted = start, None, 0, None
    save_s = 0.0  # the longest checkpoint save so far: the one after the last step must end by the limit too
    bar = tqdm(total=plan, initial=start, desc="train draft", unit="step", dynamic_ncols=True)
    while done < plan:
        step = done
        noise = torch.Generator(dev).manual_seed(seed * 1000003 + step)
        order = pack_order(len(train_packs), seed, step, per_step)
        n = max(1, sum(train_packs[i].n for i in order))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, plan, lr)
        loss_sum = correct = 0
        for i in order:
            with _autocast(dev):
                losses = pack_losses(draft, target, train_packs[i].on(dev), ttt_steps, noise, head, ce)
            part = sum(STEP_DECAY ** s * (vl + ce_weight(draft) * pl) for s, (vl, pl, _, _) in enumerate(losses)) / n
            part.backward()
            loss_sum, correct = loss_sum + part.detach(), correct + losses[0][2]
            seen += train_packs[i].real
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)  # EAGLE's clip
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        now = perf_counter()
        if time_limit is not None and done == start + 1:
            t_probe = now  # the first step pays for warm-up: timing starts after it
        stop = now > deadline - save_s  # the plan is an estimate; the limit is not
        if time_limit is not None and not stop and t_probe is not None and done - start > PROBE_STEPS and (
                fitted is None or done - fitted >= max(PROBE_STEPS, plan // REFITS)):
            # every step that fits the time left at the step time measured so far: more epochs when there is
            # time; re-fitted over the run, as the first steps (compilation, allocator warm-up) run slower
            per = max(now - t_probe, 1e-9) / (done - start - 1)
            fit = done + max(0, int((deadline - save_s - now) / per))
            plan = min(steps, fit) if steps else fit
            bar.total, fitted = plan, done
        bar.update(1)
        if done % 10 == 0 or done >= plan:  # (reading the loss waits for the device)
            bar.set_postfix(loss=f"{float(loss_sum):.3f}", acc1=f"{float(correct) / n:.3f}",
                            lr=f"{lr_at(step, plan, lr):.1e}",
                            tok_per_s=f"{seen / max(bar.format_dict['elapsed'], 1e-9):.3g}")
        if save_every and (done % save_every == 0 or done == plan or stop):
            out.mkdir(parents=True, exist_ok=True)
            t_save = perf_counter()
            torch.save({"key": key, "step": done, "plan": plan, "draft": draft.state_dict(),
                        "opt": opt.state_dict()}, out / CHECKPOINT)
            save_s = max(save_s, perf_counter() - t_save)
        if stop:
            break
    train_s = bar.format_dict["elapsed"]
    _close(bar, seen)
    after = evaluate(draft, target, held_packs, ce)
    if arch == "eagle3":
        save_draft3(draft, out, _target_record(engine_dir), "trained here")
    else:
        save_draft(draft, out, engine_dir)
    save_ranking(out / FREQ_FILE, counts)
    tokens = sum(p.real for p in train_packs)
    r = {"out": str(out), "arch": arch, "data": what, "loss": loss, "steps": done, "planned_steps": plan, "epoch_steps": total,
         "ttt_steps": ttt_steps, "train_tokens": tokens, "rows": len(train_packs),
         "epochs": round(seen / max(tokens, 1), 2), "train_tok_per_s": round(seen / max(train_s, 1e-9)),
         "loss_vocab_coverage": round(coverage, 4), "heldout_loss_start": before["loss"],
         "heldout_acc_start": before["acc"], "heldout_loss": after["loss"], "heldout_acc": after["acc"],
         "heldout_positions": after["positions"], "train_s": perf_counter() - t0}
    print(f"[train-draft] held-out top-1 at depths 1..{EVAL_DEPTHS}: {after['acc']} (start {before['acc']}), "
          f"{done} steps ({r['epochs']} epochs of {tokens:,} tokens), {r['train_s']:.0f} s", file=sys.stderr)
    if eval_tokens:
        for p in train_packs + held_packs:  # their features (views of the FeatureStores) go back to the device
            p.feats = p.aux = None
        del train_packs, held_packs, target, draft, opt, head
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the cached features go back before the evaluation engines load
        r["acceptance"], r["acceptance_by_category"] = spec_eval(engine_dir, out, device, eval_tokens, eval_methods,
                                                                 eval_questions)
        print(f"[train-draft] acceptance length (tokens per round, {eval_questions} question(s) of each of "
              f"{len(EVAL_CATEGORIES)} categories): {r['acceptance']}; per category: "
              f"{r['acceptance_by_category']}", file=sys.stderr)
    r["wall_s"] = perf_counter() - t0
    return r


def cmd_train_draft(a) -> None:
    # the distilling engine's KV pool and the cached features come and go in large blocks: without expandable
    # segments the 600 s and 720 s EAGLE-3 recipes at 34c6c51 / 5adba02 ended out of device memory (fragmentation).
    # Read when CUDA first allocates, so it is set before anything here touches the device.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if a.eval and a.eval_tokens < 1:
        raise UserError("--eval-tokens must be at least 1")
    methods = tuple(m for m in a.eval_methods.split(",") if m)
    if not methods or any(m not in EVAL_METHODS for m in methods):
        raise UserError(f"--eval-methods: a comma-separated subset of {','.join(EVAL_METHODS)}, got {a.eval_methods!r}")
    t0, time_limit, data, distilled, mix = perf_counter(), a.time_limit, a.data, None, a.mix_sharegpt
    if a.distill_time is not None and not 0 <= a.distill_time < math.inf:  # NaN fails this too
        raise UserError(f"--distill-time must be at least 0, got {a.distill_time}")
    if a.distill_time is None and time_limit is not None and data is None:
        # the recipe: a share of the time distills the target's own answers, mixed with ShareGPT for the rest
        a.distill_time, mix = DISTILL_SHARE * time_limit, True
        print(f"[train-draft] the recipe: distill {a.distill_time:.0f} s, then train on the answers + ShareGPT "
              f"(--distill-time 0: ShareGPT only)", file=sys.stderr)
    if a.distill_prompts is not None and not a.distill_time:
        raise UserError("--distill-prompts is what distilling answers: it goes with --distill-time N (or the recipe's "
                        "--time-limit without --data)")
    if a.distill_time:  # one command: distill into --data (default <out>/distilled), then train on it
        from .distill import distill
        if time_limit is not None and a.distill_time >= time_limit:
            raise UserError(f"--distill-time {a.distill_time} leaves no training time in --time-limit {time_limit}")
        data = data or str(Path(a.out) / "distilled")
        distilled = distill(a.engine, data, conversations=a.conversations, turns=a.distill_turns,
                            max_tokens=a.distill_max_tokens, max_prompt=a.distill_max_prompt,
                            temperature=a.distill_temperature, top_p=a.distill_top_p, top_k=a.distill_top_k,
                            seed=a.seed, max_batch=a.distill_max_batch, kv_memory=a.distill_kv_memory,
                            device=a.device, time_limit=a.distill_time, prefix_cache=a.distill_prefix_cache,
                            prompts=a.distill_prompts)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the engine's KV pool goes back before the features are cached
        if time_limit is not None:
            time_limit -= perf_counter() - t0
    r = train(a.engine, a.out, conversations=a.conversations, max_len=a.max_len, steps=a.steps, epochs=a.epochs,
              lr=a.lr, batch_tokens=a.batch_tokens, seed=a.seed, device=a.device, arch=a.arch,
              ttt_steps=a.ttt_steps if a.ttt_steps is not None else EAGLE3_TTT if a.arch == "eagle3" else 1,
              resume=a.resume, save_every=a.save_every, heldout=a.heldout, time_limit=time_limit,
              eval_tokens=a.eval_tokens if a.eval else 0, distilled=data, mix_sharegpt=mix,
              heldout_data=a.heldout_data, loss=a.loss, loss_vocab=a.loss_vocab, eval_methods=methods,
              eval_questions=a.eval_questions)
    if distilled is not None:
        r["distill"] = distilled
        r["wall_s"] = perf_counter() - t0
    print(json.dumps(r))


def register(sub) -> None:
    from .distill import add_distill_args

    p = sub.add_parser("train-draft", help="train an EAGLE-1/2 or (--arch eagle3) EAGLE-3 draft head for an engine "
                                           "(ShareGPT and/or the target's own answers from `microspec distill`)")
    p.add_argument("--engine", required=True, help="engine directory or model key")
    p.add_argument("--out", required=True, help="draft directory (config.json + model.safetensors, checkpoint.pt)")
    p.add_argument("--conversations", type=int, help="first N conversations of ShareGPT (and of --distill-prompts) "
                   "(default: all)")
    p.add_argument("--data", help="a `microspec distill` directory: train on the target's own answers (alone, or "
                                  "with --mix-sharegpt); its last --heldout fraction is the held-out set")
    p.add_argument("--mix-sharegpt", action="store_true", help="with --data: also train on ShareGPT's "
                   "conversations (the distilled rows come first when --time-limit leaves some data out)")
    p.add_argument("--heldout-data", help="a `microspec distill` directory whose last --heldout fraction is the "
                   "held-out set (default: --data's; without --data, ShareGPT's): arms on other data compare")
    p.add_argument("--distill-time", type=float, help="first distill for this many seconds into --data (default "
                   "<out>/distilled), then train on it; --time-limit counts both. Default: with --time-limit and no "
                   "--data, a third of it, mixed with ShareGPT (the recipe); 0: no distilling")
    add_distill_args(p, "distill-")
    p.add_argument("--max-len", type=int, default=4096, help="tokens per packed row (and per conversation)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: from --epochs; under --time-limit, at most)")
    p.add_argument("--epochs", type=float, default=3.0, help="epochs over the data; under --time-limit the least "
                   "the planned data gets (more when there is time; less data when the time holds fewer)")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    p.add_argument("--batch-tokens", type=int, default=32768, help="tokens per optimizer step (whole rows)")
    p.add_argument("--ttt-steps", type=int, help="unrolled draft steps per position (training-time test; "
                   f"default 1 = EAGLE's single-step recipe, {EAGLE3_TTT} with --arch eagle3)")
    # eagle3 by default: on the H200 its one-command recipe at 600 s accepted 3.48 tokens a round where EAGLE-2's at
    # 420 s accepted 2.45 (BENCHMARKS.md, Training)
    p.add_argument("--arch", default="eagle3", choices=ARCHS, help="eagle2: an EAGLE-1/2 head (fc over [embedding ; "
                   "final feature], the target's LM head, feature + token loss); eagle3: an EAGLE-3 head (fc over "
                   "three target layers, its own LM head over the --loss-vocab most frequent answer ids, started from "
                   "the target's rows and trained, token loss only, --ttt-steps unrolled)")
    p.add_argument("--loss", default="pruned", choices=LOSSES, help="token loss: pruned = soft CE over the "
                   "--loss-vocab ids most frequent in the training answers (the default: on the H200 it trained 2.3x "
                   "the tokens/s of full, and with distilled data won the equal-wall-time A/B); full = over the whole "
                   "vocabulary (the reference); fused = full's loss with its softmax part in one Triton kernel (CUDA)")
    p.add_argument("--loss-vocab", type=int, default=32768, help="ids of --loss pruned")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps; 0: none (e.g. when "
                                                               "--out is the package's shipped head)")
    p.add_argument("--heldout", type=float, default=0.02, help="fraction of the conversations held out")
    p.add_argument("--time-limit", type=float, help="seconds of wall time since the start (distilling, caching "
                   "and the held-out evaluation included; --eval after it) by which the head is made: the data and "
                   "the schedule are planned from measured rates. Without --data it distills first (--distill-time)")
    p.add_argument("--eval", action="store_true", help="after training, the acceptance length of the head on "
                                                       "Spec-Bench + HumanEval prompts (eagle and microspec)")
    p.add_argument("--eval-tokens", type=int, default=256, help="new tokens per --eval prompt")
    p.add_argument("--eval-methods", default=",".join(EVAL_METHODS), help="--eval's methods")
    p.add_argument("--eval-questions", type=int, default=1, help="--eval's questions per category")
    p.set_defaults(func=cmd_train_draft)
