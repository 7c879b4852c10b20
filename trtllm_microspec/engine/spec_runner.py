"""The speculative runner: BatchRunner (engine/runner.py) with an EAGLE draft, every request's draft vocabulary
and the speculation policy (engine/policy.py); its rounds (speculative/batch_tree.py) and plain steps (AR's step,
the draft deferred to a lag buffer) go through the same scheduler, block pool and CUDA graphs as AR's steps."""
from __future__ import annotations

import time
from collections import deque

import torch

from .. import parallel
from ..models.model import KVCache, Span, Transformer
from ..speculative.batch_tree import accept, causal_mask, draft_trees, physical, verify
from ..speculative.sampling import tempered
from ..speculative.tree import TreeConfig
from ..vocab.batched import batch_vocab
from ..vocab.strategies import Window
from .graphs import bucket_for
from .policy import SpecPolicy, StepCosts, tree_shapes
from .runner import PREFILL_CHUNK, BatchRunner, Packed, batch_bucket, longs, round_reserve, upload

# SpecRunner: plain steps a request may run before its draft catches up (its lag buffer's rows). A round's catch-up
# pass is padded to LAG rows a request, so a round has two variants (graphs), with and without one: with a bucket per
# lag (1, 2, 4, .. LAG), the `auto` policy's mix of shapes meets a new graph (an eager run, then a capture) far more
# often (on the H200 its summarization turn took 0.64 s where `fixed`'s took 0.36 s, ~0.3 s past its steps' costs).
# A draft pass over 16 rows a request costs what one over 1 does at small batches (it reads the layer's weights once)
LAG = 16


class SpecRunner(BatchRunner):
    """Batched EAGLE-2 rounds (every speculative method: eagle, frspec, the MicroSpec windows and their
    ablations) with an EAGLE-1/2 or EAGLE-3 head: every request drafts its own tree through its own draft
    vocabulary, one target pass verifies all trees, acceptance and KV compaction per request. make_vocab's
    vocabulary becomes the batch's (vocab/batched.py): shared full/static rows, or a MicroSpec window (ring, counts,
    active ids, packed head rows) per batch slot, reset when a request joins. Each step runs the shape the
    speculation policy picks (engine/policy.py): a tree, or plain rows (AR's step; the window's ids deferred, the
    draft's rows kept in a lag buffer for the request's next round). A decode-only step is one device step with no
    host read but the one of its results, captured in a CUDA graph per (shape, rows bucket, head slots bucket, span
    bucket, sampling mode, catch-up rows bucket); padding rows leave every window as it is. A plain decode-only
    step, like AR's, may be launched before the step in flight is read (Scheduler overlap: `overlappable`); a round
    or a pass with prompt chunks reads it first. The draft is called through `draft.cfg` (the shapes of the KV
    pool allocated for it), `draft.hidden(tokens, features, positions, slots, span, cache=)`, `draft.features(h)`
    (its input feature from the target's pass that gave h: the hidden itself, EAGLE-3 its three tapped layers) and
    `draft.head_in(h)` (the vocabulary head's input) only. A step with prompt chunks packs them as AR does (BatchRunner.pack, no padding
    rows, under the token budget alone; graphed up to graph_rows) and runs the draft over the same rows, and the
    LM head's top-K_pre over them; a request that joins a batch too big for any tree to pay, or that asks not to
    speculate (SamplingParams.speculate), decodes as AR's (decided as it joins: `shares_prefix`; it may start from
    the prefix cache): a step of such requests alone is AR's step, and in a round it rides along, its tree verified
    but none of it accepted (one token, AR's); when the
    step's shape is plain, the decode rows go into the same target and draft pass; a tree's round runs after the
    chunks' pass. A request's blocks are all taken when it joins: its window and draft state could not be
    recomputed token for token after a preemption, so none is preempted."""

    grows = False
    inputs = 4  # BatchRunner's rows, then each row's lag (its pending plain steps)

    def __init__(self, target: Transformer, draft, vocab, tree: TreeConfig, k_pre: int, k_ver: int,
                 max_batch: int, kv_memory: float | None = None, cuda_graphs: bool = False,
                 max_num_tokens: int | None = None, spec_policy: str = "auto", costs: StepCosts | None = None,
                 k_tree: int = 0, prefix_cache: bool = False):
        """spec_policy: auto (engine/policy.py: each step's tree from the step's cost and the requests' acceptance)
        or fixed (always `tree`); costs: the policy's cost model (None: measured by timing padding rounds).
        k_tree: a MicroSpec window also takes the target's top-k_tree ids at every verified tree node (see _round).
        prefix_cache: the pool's prefix cache, for the requests that decode as AR's (`shares_prefix`)."""
        shapes = tree_shapes(tree, spec_policy)
        window_pre = isinstance(vocab, Window) and vocab.use_prompt  # it keeps prompt_rows (below)
        super().__init__(target, max_batch, kv_memory, cuda_graphs, draft_cfg=draft.cfg,
                         reserve=max(round_reserve(t) for t in shapes if t),
                         max_num_tokens=max_num_tokens,
                         slot_bytes=(1 + k_pre) * 8 if window_pre else 0, prefix_cache=prefix_cache)
        self.draft, self.tree, self.k_pre, self.k_ver, self.k_tree = draft, tree, k_pre, k_ver, k_tree
        self.shapes = shapes
        self.policy = SpecPolicy(shapes, spec_policy, costs or StepCosts(self.measure))
        self.planned: int | None = None  # the shape the scheduler planned this step's budget with
        dev = self.device
        # the draft's own KV pool, with the target's block ids (draft.cfg: its layers and KV shapes)
        self.dcache = KVCache(draft.cfg, draft.cfg.num_layers, self.cache.k.dtype, dev, slots=self.cache.pos.numel())
        self.vocab = batch_vocab(vocab, max_batch + 1)  # the padding slot too: padding rows read it
        if hasattr(self.vocab, "reset"):  # every slot a valid (pinned ids) window: a padding row may read a free one
            self.vocab.reset(torch.arange(max_batch + 1, device=dev))
        self.h_last = torch.zeros(max_batch + 1, draft.cfg.hidden_size, dtype=self.cache.k.dtype, device=dev)
        self.steps = torch.arange(tree.max_path, device=dev)
        self.steps_lag = torch.arange(LAG, device=dev)
        # only a MicroSpec window that starts from its prompt reads top-K_pre: the others skip the LM head over
        # every prompt row (shared rows: eagle, frspec; ext-only starts from the first token's top-K_ver)
        self.window_pre = window_pre
        self.spec_out: dict[tuple[int, int], torch.Tensor] = {}  # a graphed packed pass's tokens and top-K_ver
        # each pool slot's prompt id and top-K_pre ids, written by the pass that prefills the slot: the windows a
        # pass starts gather their prompts' rows through the block table at once, however many chunks each took
        # (a request's blocks hold its rows until it leaves; k_pre + 1 longs a slot beside its KV's kilobytes)
        self.prompt_rows = torch.full((self.cache.pos.numel(), 1 + k_pre), -1, dtype=torch.long, device=dev) \
            if self.window_pre else None
        # what the host reads after a round, per row: accepted k, vocabulary size, covered, emitted tokens
        self.out = torch.zeros(max_batch, 3 + tree.max_path, dtype=torch.long, device=dev)
        # The lazy draft: a plain step is AR's step (BatchRunner._decode, or a decode row beside prompt chunks) and
        # leaves the draft alone; it keeps, per batch slot, the target's feature of its row and the token it emitted
        # (the draft's input of the catch-up row the step would have run) in a lag buffer, at the row's index `lag`.
        # A request's next round (or a plain step that finds some buffer full) first runs the draft over its
        # pending rows in one causal pass (`_catch_up`): the draft's KV at those positions and h_last as the
        # per-step catch-up makes them. LAG <= reserve: a catch-up's padding rows (past a row's lag) write draft KV
        # slots at most `reserve` past the committed length, which the round overwrites before reading (as a tree's
        # expansions).
        self.lag_max = max(1, min(LAG, self.reserve))
        taps = getattr(draft, "taps", None)  # EAGLE-3: its features are the target's tapped layers, side by side
        fdim = target.cfg.hidden_size * (len(taps) if taps else 1)
        self.lag_feat = torch.zeros(max_batch + 1, self.lag_max, fdim, dtype=self.cache.k.dtype, device=dev)
        self.lag_tok = torch.zeros(max_batch + 1, self.lag_max, dtype=torch.long, device=dev)
        # and the step's verified top-K_ver ids, which join the window's deferred ids (vocab.defer) at the catch-up
        self.lag_ver = torch.full((max_batch + 1, self.lag_max, k_ver), -1, dtype=torch.long, device=dev)
        self.lags = [0] * (max_batch + 1)  # per batch slot on the host: its pending rows (the device reads inp[3])
        # each overlapped step in flight, oldest first (`read`): why it runs plain, its rows bucket, and whether its
        # time is a plain step's cost (not a graph's first use, nor a step of requests that decode as AR's)
        self.whys: deque[tuple[str, int, bool]] = deque()
        self.calibrated = False  # every step cost the policy weighs measured (calibrate): prompts_pay may use them
        self.joins_pay: bool | None = None  # prompts_pay's answer for the step's joins (None: not asked yet)
        # per batch slot on the device: whether its request decodes as AR's (req.stats.speculative False, decided as it
        # joins: `shares_prefix`), so that a round accepts none of its tree (`_round`)
        self.rides = torch.zeros(max_batch + 1, dtype=torch.bool, device=dev)

    def shares_prefix(self, req) -> bool:
        """Whether req, joining now, speculates is decided here: not where it asks not to (SamplingParams.speculate),
        nor where the batch it joins is too big for any tree to pay (prompts_pay). Such a request decodes as AR's to
        its end -- AR's passes, its draft never run, no window, no lag buffer -- so that a batch of them costs what
        AR's costs (at 64 and 256 requests on the H100 the draft's prompt pass, lag buffers and catch-ups made
        microspec 0.67x / 0.90x AR while every step but probes ran plain); decided once: it never speculates later,
        when its batch shrinks. One that decodes as AR's may start from the prefix cache's blocks: it needs only
        their target KV, which every request that left there held for its committed tokens (a speculating one too).
        One that speculates prefills its whole prompt: its window and draft state start from every row of it."""
        if req.stats.speculative is None:
            req.stats.speculative = req.params.speculate and self.prompts_pay()
        return not req.stats.speculative

    def join(self, req, blocks: list[int]) -> None:
        super().join(req, blocks)  # (the scheduler asked shares_prefix first: req.stats.speculative is decided)
        self.lags[req.slot] = 0
        self.rides[req.slot] = not req.stats.speculative

    def _as_ar(self, chunks: list[tuple], decodes: list) -> bool:
        """Whether every request of this step decodes as AR's (`shares_prefix`): then the step is AR's own."""
        return all(r.stats.speculative is False for r in [req for req, _ in chunks] + decodes)

    def _choose(self, reqs: list, Bb: int) -> int:
        """The policy's shape for a decode step of `reqs`: the speculating ones' expected tokens against the step's
        cost, the ones that decode as AR's counted for one token whatever the shape (in a round they ride along:
        `_round`); plain where none speculates ("cost")."""
        spec = [r for r in reqs if r.stats.speculative]
        if not spec:
            self.policy.why = "cost"
            return 0
        return parallel.agree(self.policy.choose(spec, Bb, len(reqs) - len(spec)), self.device)

    def step(self, chunks: list[tuple], decodes: list) -> tuple[list[list[int] | None], list[list[int]]]:
        """Without chunks, the (graph-captured) round of the planned shape. With chunks, one packed target pass and
        one draft pass over them, the decode rows in it too when the planned shape is plain; a planned tree's round
        runs after that pass (its verify rows are not merged into the packed pass: a tree's anc mask would be one
        more Span part, not done yet)."""
        if self._as_ar(chunks, decodes):  # AR's step, its statistics as a plain step's
            self.planned = None
            firsts, decoded = BatchRunner.step(self, chunks, decodes)
            for r in decodes:
                self.count_step(r, 1)
            return firsts, decoded
        if not chunks:
            return [], self.decode(decodes) if decodes else []
        if decodes and self.planned is None:
            self.plan(decodes)
        if decodes and self.shapes[self.planned] is None:
            self.planned = None
            return self.packed(chunks, decodes)
        return self.packed(chunks, [])[0], self.decode(decodes) if decodes else []

    def packed(self, chunks: list[tuple], decodes: list) -> tuple[list[list[int] | None], list[list[int]]]:
        """One target pass and one draft pass over the packed chunks and plain decode rows (`_packed`), replayed
        from a CUDA graph per (rows bucket, sampled rows bucket, sampling mode) up to graph_rows rows, as AR's. Then,
        eagerly (their sizes vary), the windows of every prompt the pass completes start together, from their
        prompts and top-K_pre. The decode rows are plain steps as a decode-only one's: each one's draft row (its
        feature, token and top-K_ver) joins its lag buffer for its request's next round (a full buffer is caught
        up first, eagerly)."""
        lags = [self.lags[r.slot] for r in decodes]
        if decodes and max(lags) == self.lag_max:
            self.catch_up(decodes)
            lags = [0] * len(decodes)
        nxt = []
        for req, c in chunks:
            after = req.prompt[req.prefilled + 1:req.prefilled + c + 1]  # one short at the prompt's end
            nxt += after + [0] * (c - len(after))
        # top-K_pre where a prompt of the pass speculates (a pass of those that do not is AR's: `step`)
        pre = self.window_pre and any(req.stats.speculative for req, _ in chunks)
        pad = self.packed_pad(chunks, decodes)
        # per row: the draft's next token (a prompt's), and a decode row's lag + 1 (0: a prompt's row)
        p = self.pack(chunks, decodes, [longs(nxt + [0] * len(decodes)),
                                        longs([0] * len(nxt) + [x + 1 for x in lags])], pad=pad)
        mode, R = self.sampler.mode(p.sample), len(p.sample)
        if pad:
            if pad not in self.spec_out:
                self.spec_out[pad] = torch.zeros(pad[1], 1 + self.k_ver, dtype=torch.long, device=self.device)
            out = self.spec_out[pad]
            self.launch(("spec-packed", *pad, mode, pre), lambda: out.copy_(self._packed(p, mode, pre)))
        else:
            out = self._packed(p, mode, pre)
        tok, ver = out[:R, 0], out[:R, 1:]
        if p.ends:  # the windows of every prompt this pass completes start together
            n = len(p.ends)
            if self.window_pre:  # the prompts' rows from the pool slots the passes wrote them to
                lens = [len(chunks[b][0].prompt) for b in p.ends]
                prompt, topk = self.prompts(p.slot[:n], upload(longs(lens), self.device), max(lens))
            else:
                prompt, topk = None, None
            self.vocab.start(p.slot[:n], prompt, topk, None if self.vocab.use_prompt else ver[:n])
        self.vocab.join()  # the new windows' packed rows, gathered on the copy stream
        # (no policy.observe: the step's time is mostly its chunks', not a plain step's cost)
        for r, lag in zip(decodes, lags):  # a plain step's one token is no acceptance: its size and why only
            self.lags[r.slot] = lag + 1 if r.stats.speculative else 0  # (one decoding as AR's never catches up)
            self.count_step(r, 1)
        return self.advance(chunks, decodes, tok.tolist())  # the one host read of the step

    def prompts_pay(self) -> bool:
        """Whether the requests that join now may speculate (`shares_prefix`): not where the batch
        they join -- the running requests and those queued behind them (`queued`, the scheduler's), up to max_batch
        -- is too big for any tree to pay at the policy's step costs (calibrated, corrected by the steps run:
        policy.pays). Only with the costs calibrated (calibrate: at start-up on CUDA); without (the CPU's, measured
        on first need by timings that vary run to run), every request speculates."""
        if not self.calibrated:
            return True
        if self.joins_pay is None:  # once for the step's joins: n is the same for each (one more running, one fewer
            # queued), and under --tp each answer is a broadcast and a host read
            n = min(self.max_batch, self.max_batch - len(self.free_slots) + self.queued)
            self.joins_pay = bool(parallel.agree(int(self.policy.pays(n, batch_bucket(n, self.max_batch))),
                                                 self.device))
        return self.joins_pay

    def map_blocks(self, updates: list[tuple[int, int, int]]) -> None:
        super().map_blocks(updates)
        self.joins_pay = None  # the step's joins are over (map_blocks ends every schedule): the next step asks anew

    def _packed(self, p: Packed, mode: str, pre: bool = True) -> torch.Tensor:
        """`packed`'s device work, what its graph replays: the target's pass, every row's top-K_pre into
        prompt_rows (-1 without `pre`: prompts_pay; a decode's or padding row's lands at its own pool slot, past
        any prompt: never read), each sampled row's token and top-K_ver, and the draft's pass. The draft at row i
        reads the target's feature there and token i + 1: the prompt's next one, or its first token sampled in
        this pass at its last row, so a chunk needs nothing from the next one; that row's draft hidden starts the
        request's first round (h_last). A decode row is a plain step (`_plain`): its feature, token and top-K_ver
        go to its lag buffer at its lag (extra[1] - 1); the draft pass's output there is not used (its draft KV is
        rewritten by the catch-up). Returns [sampled rows, 1 + k_ver]: each one's token, then its top-K_ver."""
        t, d = self.target, self.draft
        h = t(p.tokens, self.positions(p.slots), p.slots, p.spans, cache=self.cache)
        feat = d.features(h)  # the target's hidden (EAGLE-2) or its three layers (EAGLE-3) of this pass
        if self.window_pre:  # every row's top-K_pre, PREFILL_CHUNK rows per LM-head call (never [rows x V])
            M = p.tokens.numel()
            top = torch.cat([t.topk(t.logits(h[i:min(i + PREFILL_CHUNK, M)]), self.k_pre)
                             for i in range(0, M, PREFILL_CHUNK)]) if pre else p.tokens.new_full((M, self.k_pre), -1)
            self.prompt_rows.index_copy_(0, p.spans.physical(p.slots), torch.cat([p.tokens[:, None], top], 1))
        if not p.rows.numel():  # (an eager pass that completes no prompt and has no decode rows)
            tok = logits = None
        else:
            logits = t.logits(h[p.rows])
            tok = self.sampler.choose(logits, p.slot, p.at, mode)
        nxt = p.extra[0] if tok is None else p.extra[0].index_copy(0, p.rows, tok)
        dh = d.hidden(nxt, feat, self.positions(p.slots), p.slots, p.spans, cache=self.dcache)
        if tok is None:
            return torch.zeros(0, 1 + self.k_ver, dtype=torch.long, device=self.device)
        lag1 = p.extra[1].index_select(0, p.rows)
        dec = lag1 > 0  # a decode row (else a prompt's last row, or padding): the other kind writes the padding slot
        self.h_last.index_put_((torch.where(dec, self.pad, p.slot),), dh[p.rows])
        ver = t.topk(logits, self.k_ver)
        self._keep((torch.where(dec, p.slot, self.pad), (lag1 - 1).clamp(min=0)), feat[p.rows], tok, logits, ver)
        return torch.cat([tok[:, None], ver], 1)

    def prompts(self, slots: torch.Tensor, lens: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts [B, L] and their rows' top-K_pre ids [B, L * k_pre], -1 padded, of the requests in batch
        slots `slots` (prompt lengths `lens`, L the longest), read from the pool slots of their rows (prompt_rows):
        a few ops for the whole batch, whatever the passes that wrote each row."""
        B = slots.numel()
        cols = torch.arange(L, device=self.device)
        rows = self.prompt_rows[physical(self.table.index_select(0, slots), cols.expand(B, L))]  # [B, L, 1 + k_pre]
        rows = torch.where((cols < lens[:, None])[..., None], rows, -1)  # past a prompt: another's rows, or none
        return rows[..., 0], rows[..., 1:].flatten(1)

    def plan(self, reqs: list) -> int:
        """The policy's shape for this step's decoding requests; returns the target rows each of them adds."""
        # under --tp rank 0's choice (it rests on each rank's own timings): every rank runs the same shape
        self.planned = self._choose(reqs, batch_bucket(len(reqs), self.max_batch))
        tree = self.shapes[self.planned]
        return tree.total_tokens if tree else 1

    def decode(self, reqs: list) -> list[list[int]]:
        """One step for the batch in the planned shape: a draft / verify / update round, or plain decode rows
        (AR's step, the draft's catch-up rows kept for the next round: `_plain`)."""
        shape, Bb, t0 = self._launch_decode(reqs)
        B = len(reqs)
        if self.shapes[shape] is None:  # AR's step: its tokens alone
            res = [[0, 0, 0, tok] for tok in self.next[:B].tolist()]  # the one host read per step
        else:
            res = self.out[:B].tolist()  # the one host read per round
        took = time.perf_counter() - t0 if t0 is not None else None
        spec = [(r, row[0] + 1) for r, row in zip(reqs, res) if r.stats.speculative]  # (riders accept nothing)
        self.policy.observe([r for r, _ in spec], shape, Bb, [t for _, t in spec], took)
        tree_size = self.shapes[shape].total_tokens if self.shapes[shape] else 1
        out = []
        for r, (k, size, covered, *emitted) in zip(reqs, res):
            s = r.stats
            size_of = tree_size if s.speculative else 1  # one that decodes as AR's rode the round: a plain step
            self.count_step(r, size_of)
            if size_of > 1:  # speculative rounds only: a plain step's one token is no acceptance
                s.rounds += 1
                s.round_tokens += k + 1
                s.vocab_sum += size
                s.vocab_max = max(s.vocab_max, size)
                s.covered += covered
            r.n += k + 1
            r.last = emitted[k]
            out.append(emitted[:k + 1])
        return out

    def _launch_decode(self, reqs: list) -> tuple[int, int, float | None]:
        """`decode`'s step launched, nothing read: its shape, its rows bucket, and when it started where its time
        is a step's cost (None: a graph's first use)."""
        B = len(reqs)
        Bb = batch_bucket(B, self.max_batch)
        shape = self._choose(reqs, Bb) if self.planned is None else self.planned
        self.planned = None
        plain = self.shapes[shape] is None
        # the batched draft head multiplies slots 0 .. top-1 in place (vocab/batched.py): top covers every slot
        top = 1 if plain else batch_bucket(max(r.slot for r in reqs) + 1, self.max_batch)
        lags = [self.lags[r.slot] for r in reqs]
        # the catch-up's rows: a round's, its requests' pending ones; a plain step's, none unless a buffer is full
        L = max(lags) if not plain or max(lags) == self.lag_max else 0
        Lb = 0 if L == 0 else self.lag_max
        t0 = time.perf_counter()
        S, mode = self.prepare(reqs, Bb, [lags])
        key = (shape, Bb, top, S, mode, Lb)
        timed = self.replays(key)  # a first use's time is no step's cost: the policy would shun the shape for it
        self.launch(key, lambda: self._round(shape, Bb, top, S, mode, Lb))
        for r in reqs:
            self.lags[r.slot] = (1 if Lb else self.lags[r.slot] + 1) if plain and r.stats.speculative else 0
        return shape, Bb, t0 if timed else None

    def overlappable(self, chunks: list[tuple], decodes: list) -> bool:
        """A plain decode-only step is AR's step: its lengths are known before its tokens, so it may be launched
        before the step in flight is read and read after the next one is launched (Scheduler overlap). A round's
        lengths are its accepted tokens, and a pass with prompt chunks starts windows from host reads: those run
        synchronously, after the step in flight is read."""
        if self._as_ar(chunks, decodes):  # AR's step, prompt chunks and all
            return True
        return not chunks and bool(decodes) and self.planned is not None and self.shapes[self.planned] is None

    def step_async(self, chunks: list[tuple], decodes: list) -> tuple[list[tuple], torch.Tensor, object]:
        """An overlappable step (a plain one) launched, as BatchRunner's: the requests are left as they are, the
        scheduler advances them and reads the tokens later. Its time is no step's cost (the host does not wait
        for it): the policy sees only its plain step (PROBE). A step of requests that all decode as AR's is AR's."""
        if self._as_ar(chunks, decodes):
            self.planned = None
            self.whys.append(("cost", 0, False))
            return BatchRunner.step_async(self, chunks, decodes)
        shape, Bb, t0 = self._launch_decode(decodes)
        self.policy.observe(decodes, shape, Bb, [1] * len(decodes), None)  # its time comes with its tokens
        self.whys.append((self.policy.why, Bb, t0 is not None))  # counted when its tokens are read (`read`)
        return self.launched([(r, False) for r in decodes], self.next[:len(decodes)])

    def count_step(self, req, size: int, why: str | None = None) -> None:
        """A decoding step of `size` tree tokens in a request's statistics; a plain one (1) with why it was plain:
        a request that decodes as AR's, because it asked ("request") or joined where no tree paid ("cost"); one that
        speculates, the policy's why (`why`: an overlapped step's, chosen before the steps since)."""
        stats = req.stats
        stats.tree_sizes[size] = stats.tree_sizes.get(size, 0) + 1
        if size == 1:
            if stats.speculative is False:
                why = "cost" if req.params.speculate else "request"
            else:
                why = why or self.policy.why
            stats.plain_reasons[why] = stats.plain_reasons.get(why, 0) + 1

    def read(self, reqs: list, seconds: float | None) -> None:
        """The oldest overlapped step's tokens were emitted to `reqs` (its rows of requests that finished at the
        step before are dropped: those ran no step of theirs): each request's plain step counted, and its time
        (`seconds`) the plain shape's cost at its rows bucket. Without it a plain step's cost would stay as
        calibrated wherever plain steps overlap (every decode-only one), and that reads low: at one request on the
        H200 1.56 ms for a step that ran at 1.95, so speculation was priced 1.25x dearer than it was."""
        why, Bb, timed = self.whys.popleft()
        if timed and seconds is not None:
            self.policy.timed(0, Bb, seconds)
        for r in reqs:
            self.count_step(r, 1, why)

    def measure(self, shape: int, Bb: int) -> float:
        """Seconds of one step of `shape` over Bb padding rows (the policy's cost calibration): the same launch,
        bucket and host read as a real step, on CUDA through its captured graph (captured here, so the first real
        step of the bucket replays it). Padding rows write only the pool's block 0 and change no window."""
        self.inp[:, :Bb].copy_(torch.tensor([0, 0, self.pad, 0], device=self.device)[:, None].expand(4, Bb))
        S = bucket_for(self.reserve, self.target.cfg.max_seq_len) if self.graphs else self.reserve
        mode = self.sampler.mode([self.pad])
        plain = self.shapes[shape] is None
        top = 1 if plain else Bb
        key = (shape, Bb, top, S, mode, 0)  # (a round with no pending rows: a catch-up costs the policy nothing yet)
        times = []
        for i in range(5 if self.graphs else 3):  # CUDA: eager, capture, then 3 timed replays; CPU: 1 warm-up
            t0 = time.perf_counter()
            self.launch(key, lambda: self._round(shape, Bb, top, S, mode, 0))
            (self.next if plain else self.out)[:1].tolist()
            times.append(time.perf_counter() - t0)
        return min(times[2 if self.graphs else 1:])

    def calibrate(self) -> None:
        """Every (shape, rows bucket) the policy may weigh, measured now (start-up on CUDA: graphs captured)."""
        if self.policy.policy == "fixed":
            return
        Bb = 1
        while True:
            for shape in range(len(self.shapes)):
                self.policy.costs(shape, Bb)
            if Bb >= self.max_batch:
                break
            Bb = batch_bucket(Bb + 1, self.max_batch)
        self.calibrated = True

    def catch_up(self, reqs: list) -> None:
        """Eagerly, the draft over the pending rows of `reqs` (a mixed step's decodes, one of whose lag buffers is
        full): their draft KV and h_last as after per-step catch-up rows; their lags back to 0."""
        B = len(reqs)
        S, _ = self.prepare(reqs, B, [[self.lags[r.slot] for r in reqs]])
        L = max(self.lags[r.slot] for r in reqs)
        slots = self.inp[2, :B]
        self.h_last[slots] = self._catch_up(B, min(batch_bucket(L, self.lag_max), self.lag_max), S,
                                            self.table.index_select(0, slots))
        for r in reqs:
            self.lags[r.slot] = 0

    def _catch_up(self, Bb: int, Lb: int, S: int, table: torch.Tensor) -> torch.Tensor:
        """One causal draft pass over every row's pending rows (inp[3] of them, padded to Lb): row i of a request
        with lag L and committed length n is the plain step at position n - L + i, its token and the target's
        feature there from the lag buffer. Returns each row's h_last (its last pending row's draft hidden; a row
        with none pending keeps its own). Padding rows past a row's lag write draft KV at slots n .. n + Lb - L - 1,
        which the round's draft overwrites before it reads them."""
        n, slots, lag = self.inp[1, :Bb], self.inp[2, :Bb], self.inp[3, :Bb]
        start = n - lag
        pos = (start[:, None] + self.steps_lag[:Lb]).flatten()
        tok = self.lag_tok.index_select(0, slots)[:, :Lb].flatten()
        feat = self.lag_feat.index_select(0, slots)[:, :Lb].flatten(0, 1)
        h = self.draft.hidden(tok, feat, pos, pos, Span(start, causal_mask(Lb, self.device).expand(Bb, Lb, Lb), S,
                                                        table), cache=self.dcache).view(Bb, Lb, -1)
        if self.vocab.takes_ids:  # the pending rows' verified ids, oldest first, to the window's deferred ones
            pending = (self.steps_lag[None, :Lb] < lag[:, None]) & (slots != self.pad)[:, None]
            ver = self.lag_ver.index_select(0, slots)[:, :Lb]
            self.vocab.defer(slots, torch.where(pending[:, :, None], ver, -1).flatten(1))
        last = h.gather(1, (lag - 1).clamp(min=0)[:, None, None].expand(Bb, 1, h.shape[-1]))[:, 0]
        return torch.where((lag > 0)[:, None], last, self.h_last.index_select(0, slots))

    def _plain(self, Bb: int, S: int, mode: str, Lb: int) -> None:
        """A plain step: AR's step (its tokens into self.next), the draft skipped; each row's target feature, token
        and verified top-K_ver ids (for its next round's window update) into its lag buffer at index lag (0 after
        a catch-up of full buffers, Lb > 0)."""
        slots, lag = self.inp[2, :Bb], self.inp[3, :Bb]
        if Lb:
            table = self.table.index_select(0, slots)
            self.h_last[slots] = self._catch_up(Bb, Lb, S, table)
            lag = self.steps[:1].expand(Bb)  # zero
        h, logits = self._decode(Bb, S, mode)
        self._keep((slots, lag), self.draft.features(h), self.next[:Bb], logits)

    def _keep(self, at: tuple, feat: torch.Tensor, tok: torch.Tensor, logits: torch.Tensor,
              ver: torch.Tensor | None = None) -> None:
        """Plain steps' rows into their lag buffers at `at` (batch slots, lag indices): each one's target feature,
        emitted token and verified top-K_ver ids (`ver`, else from its logits)."""
        self.lag_feat.index_put_(at, feat)
        self.lag_tok.index_put_(at, tok)
        if self.vocab.takes_ids:  # (under --tp: the top-K over the ranks' vocabulary slices)
            self.lag_ver.index_put_(at, self.target.topk(logits, self.k_ver) if ver is None else ver)

    def _round(self, shape: int, Bb: int, top: int, S: int, mode: str, Lb: int) -> None:
        if self.shapes[shape] is None:
            return self._plain(Bb, S, mode, Lb)
        t, d, vocab, cfg, dev = self.target, self.draft, self.vocab, self.shapes[shape], self.device
        root, n, slots = self.inp[0, :Bb], self.inp[1, :Bb], self.inp[2, :Bb]
        table = self.table.index_select(0, slots)
        P = cfg.max_path
        temperature = self.sampler.draft_temperature(slots, mode)  # [Bb, 1]
        temperature = None if temperature is None else temperature[:, None]  # over a row's [T, d] hidden

        head = vocab.head_for(slots, top)  # each request through its own vocabulary, the batch in one GEMM

        def heads(h, k):
            return head(tempered(d.head_in(h), temperature), k)

        h_last = self._catch_up(Bb, Lb, S, table) if Lb else self.h_last[slots]
        tree = draft_trees(d, self.dcache, heads, h_last, root, n, table, S, cfg)
        steps = self.steps[:P]
        hid, logits = verify(t, self.cache, tree, n, table, S)
        N, V = tree.tokens.shape[1], logits.shape[-1]
        # greedy rows: the argmax of every node; sampling rows: one draw per node with the uniform of its position
        # (a greedy step keys no uniform: its rows and positions are not made)
        rows = pos = None
        if mode != "greedy":
            rows, pos = slots[:, None].expand(Bb, N).flatten(), (n[:, None] + 1 + tree.depth).flatten()
        choice = self.sampler.choose(logits.view(Bb * N, V), rows, pos, mode)
        path, k, emitted = accept(tree, choice.view(Bb, N), P)
        # a request that decodes as AR's rode the round (its tree from a draft never run on its text): none of its
        # tree is taken, its one token is the root's, AR's own
        k = torch.where(self.rides.index_select(0, slots), 0, k)
        valid = steps[None, :] <= k[:, None]
        size = vocab.size(slots)
        covered = (vocab.contains(slots, emitted) & valid).sum(1)
        # the accepted path's KV to the committed slots: the physical slots of n + path and n + steps at once
        moved = physical(table, n[:, None] + torch.cat([path, steps.expand(Bb, P)], 1))
        self.cache.move(moved[:, :P], moved[:, P:])  # [Bb, P] each: an index of any shape
        if vocab.takes_ids:
            # the target's top-K_ver ids for the window (none for a shared vocabulary, nor ctx-only's frozen
            # window); a padding row adds nothing to the padding slot's window
            real = (slots != self.pad)[:, None]
            if self.k_tree:  # one top-K over every node's logits, the accepted path's rows among them
                kt = max(self.k_ver, self.k_tree)
                top = t.topk(logits.flatten(0, 1), kt).view(Bb, N, kt)
                ver = top.gather(1, path[:, :, None].expand(Bb, P, kt))[:, :, :self.k_ver]
            else:
                ver = t.topk(logits.gather(1, path[:, :, None].expand(Bb, P, V)).flatten(0, 1), self.k_ver)
            ver = torch.where((valid & real)[:, :, None], ver.reshape(Bb, P, -1), -1).flatten(1)
            if self.k_tree:
                # issue 37: the misses left are content words first seen in the answer, the bonus token of a
                # round. The target's logits at the tree's rejected nodes are already here: a rejected node is
                # the accepted prefix with another guess at some depth, so its top ids are the target's next
                # tokens after a near-identical prefix, mostly those after the bonus token, which the next round
                # drafts (a look-ahead the accepted path cannot give). After ver: the stream's newest, kept first
                ver = torch.cat([ver, torch.where(real, top[:, :, :self.k_tree].flatten(1), -1)], 1)
            # the gathers run on the copy stream, behind the draft forward
            vocab.update(slots, torch.where(real, tree.tokens[:, 1:], -1), ver)
        feat = d.features(hid)  # [Bb, N, d] the target's hidden (EAGLE-2) or [Bb, N, 3 d] its layers (EAGLE-3)
        pos = (n[:, None] + steps).flatten()
        hid_path = feat.gather(1, path[:, :, None].expand(Bb, P, feat.shape[-1])).flatten(0, 1)
        h = d.hidden(emitted.flatten(), hid_path, pos, pos, Span(n, causal_mask(P, dev).expand(Bb, P, P), S, table),
                     cache=self.dcache).view(Bb, P, -1)
        self.h_last[slots] = h.gather(1, k[:, None, None].expand(Bb, 1, h.shape[-1]))[:, 0]
        vocab.join()
        self.out[:Bb, :3 + P].copy_(torch.cat([k[:, None], size[:, None], covered[:, None], emitted], 1))
