"""In-flight batching: requests join and leave a running batch at step boundaries.

`Scheduler.step()` is one boundary plus one step under a token budget (the runner's `max_num_tokens`): finished
and cancelled requests leave (their blocks go back at once); every running request past its prompt decodes one
row, a speculative one the rows of the step's planned shape (runner.plan: a tree's tokens, 1 plain); the requests
still prefilling take the rest of the budget in prompt chunks, in the order they joined; then waiting requests join
in order while the batch has room, the budget lasts and the pool has the blocks of their prompt (the first that
does not fit holds the rest back, so a long request is not starved by short ones). A chunked prompt does not stall
the running batch: the chunks and the decode rows go through ONE packed target pass (runner.step; a speculative
step of a tree shape runs its round after the chunks' pass). Each request samples with its own SamplingParams
(greedy by default): its tokens are those it gets alone with the same parameters and seed.

KV blocks grow with a request (AR; a speculative request takes all of its blocks when it joins). When the pool
cannot give a running request the slots of its step, the request that joined last is preempted (recompute, as
vLLM): its blocks go back, it leaves its batch slot, and it waits at the head of the queue to be prefilled again
with its prompt and the tokens it has emitted, after which it goes on where it was (its random stream kept): its
tokens stay those it gets alone. Every step is recorded in `history` (what it ran, and its host and GPU time when
`timing` is on). With `overlap` (DEFAULT_OVERLAP) the host schedules and launches step N + 1 while the GPU runs
step N and reads N's tokens after that, for every step the runner can launch so (AR's; a speculative runner's plain
decode-only steps): `step`.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from plugins.layers import KV_BLOCK

from ..models.registry import UserError
from ..speculative.sampling import GREEDY, SamplingParams
from .block_manager import BlockManager
from .stats import Stats, inter_token_gaps

# on: `benchmarks/gpu_overlap_check.py` on an H200 (256 random requests, fp32) gave the same tokens with it on and off
DEFAULT_OVERLAP = True
DEFAULT_MAX_BATCH = {"cuda": 256, "cpu": 16}  # requests decoded together, by device (LLM's max_batch=None)


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = GREEDY
    rid: int = field(default_factory=itertools.count().__next__)
    out: list[int] = field(default_factory=list)
    prefilled: int = 0  # tokens of prompt + out[:resumed] in the cache
    n: int = 0  # committed cache slots (prompt + emitted tokens already fed back)
    last: int = -1  # the last emitted token, not yet in the cache
    slot: int = -1  # the runner's batch slot (per-request device state), -1 while not running
    done: bool = False
    cancelled: bool = False
    error: str = ""
    stats: Stats = field(default_factory=Stats)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    emits: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of each step that emitted
    resumed: int = 0  # after a preemption: the emitted tokens prefilled again after the prompt
    preemptions: int = 0
    accept_ratio: float | None = None  # the speculation policy's running acceptance of this request (policy.py)

    @property
    def seq_len(self) -> int:
        """Tokens to prefill: the prompt, and after a preemption the tokens emitted before it."""
        return len(self.prompt) + self.resumed

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.seq_len

    def chunk(self, c: int) -> list[int]:
        """The next c tokens to prefill."""
        a = self.prefilled
        if a + c <= len(self.prompt):
            return self.prompt[a:a + c]
        return (self.prompt + self.out[:self.resumed])[a:a + c]

    @property
    def inter_token_s(self) -> list[float]:
        """Inter-token latencies: the time between two emitting steps, shared by the tokens the later one emitted
        (a speculative round emits several at once), so there is one value per token after the first."""
        return inter_token_gaps(self.emits)


@dataclass
class StepRecord:
    decodes: int  # requests that decoded (each adds `tree` rows)
    chunks: list[int]  # prompt tokens prefilled, per request
    tokens: int  # the step's target rows: decode rows + chunk tokens, at most the budget
    preempted: int  # requests preempted while the step was scheduled
    running: int  # requests in the batch after the boundary
    waiting: int
    tree: int = 0  # target rows per decoding request: the speculation policy's tree size, 1 a plain step
    start: float = 0.0  # host: perf_counter when the step began (its boundary)
    plan_s: float = 0.0  # host: the boundary and the schedule
    step_s: float = 0.0  # host: the whole step, the pass and the emission included
    launch_s: float | None = None  # host: the pass's launch alone, its tokens not awaited (overlap; None without)
    events: tuple | None = None  # CUDA events around the pass (timing on)

    @property
    def gpu_ms(self) -> float | None:
        """GPU time of the pass (waits for it)."""
        if self.events is None:
            return None
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1])


@dataclass
class Pending:
    """A step launched and not yet read (overlap): its chunks, its sampled rows' (request, a prompt's first token)
    in order, their tokens' host copy and its event."""
    chunks: list[tuple[Request, int]]
    rows: list[tuple[Request, bool]]
    tokens: torch.Tensor
    event: object  # torch.cuda.Event, None on the CPU
    t_start: float  # when its launch began
    t_launch: float  # when its launch returned


class Scheduler:
    def __init__(self, runner, max_batch: int, overlap: bool | None = None):
        """overlap: AR steps run one step ahead of their host read (see `step`); None: DEFAULT_OVERLAP."""
        if max_batch < 1:
            raise UserError(f"max_batch must be at least 1, got {max_batch}")
        self.runner, self.max_batch = runner, max_batch
        if overlap is None:
            overlap = DEFAULT_OVERLAP
        self.overlap = overlap
        self.pending: Pending | None = None  # the overlapped step in flight
        # when the device last finished what had been launched (a read of the step in flight, the end of a
        # synchronous step): an overlapped step's time is counted from it or from its own launch, the later
        self.t_done = 0.0
        self.max_seq_len = runner.target.cfg.max_seq_len
        self.blocks: BlockManager = runner.blocks
        self.stop_ids = set(runner.stop_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they joined: the last one is preempted first
        self.lock = threading.Lock()  # add / cancel may come from other threads (serving)
        self.history: deque[StepRecord] = deque(maxlen=1 << 16)
        self.timing = False  # CUDA events around every pass (profile's step timeline)
        self._updates: list[tuple[int, int, int]] = []  # blocks handed out while scheduling, for the table
        self.decode_rows = 1  # rows per decoding request of the step being scheduled (runner.plan)
        # the boundary scans the batch only after a request finished or was cancelled (set before the flag is read)
        self._finished = self._cancels = False

    @property
    def max_num_tokens(self) -> int:
        return self.runner.max_num_tokens

    def add(self, prompt: list[int], max_new_tokens: int, params: SamplingParams = GREEDY) -> Request:
        """Queue a request; a UserError now if it could never run."""
        self.runner.check(prompt, max_new_tokens)
        self.blocks.check(self.runner.slots_for(prompt, max_new_tokens), "this request")
        req = Request(prompt=list(prompt), max_new_tokens=max_new_tokens, params=params.seeded())
        req.stats.prompt_tokens = len(prompt)
        # a step's time counts for every request in it; a round's phases run as one launch: not split
        req.stats.decode_s, req.stats.draft_s, req.stats.verify_s, req.stats.update_s = 0.0, None, None, None
        with self.lock:
            self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """The request leaves at the next step boundary; its blocks go back then."""
        req.cancelled = True
        self._cancels = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _finish(self, req: Request, reason: str) -> None:
        req.done = True
        req.stats.stop_reason = reason
        req.stats.wall_s = time.perf_counter() - req.t_submit
        self.blocks.release(req.rid, None if reason == "error" else self._cached(req))
        self.runner.leave(req)
        self._finished = True

    def _boundary(self) -> None:
        cancels, finished = self._cancels, self._finished
        if not (cancels or finished):  # most steps: nothing left the batch
            return
        self._cancels = self._finished = False  # before the scans: a cancel during them is seen next step
        gone = [r for r in self.running if r.cancelled or r.done]
        if gone:
            self.running[:] = [r for r in self.running if not (r.cancelled or r.done)]
            for req in gone:
                if not req.done:
                    self._finish(req, "cancelled")
        if cancels and any(r.cancelled for r in self.waiting):
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                req.done, req.stats.stop_reason = True, "cancelled"

    def _grow(self, req: Request, slots: int) -> bool:
        """req's blocks cover `slots`: True, or False (nothing taken) when the pool has too few free."""
        have = self.blocks.held(req.rid)
        new = self.blocks.grow(req.rid, slots)
        if new is None:
            return False
        self._updates += [(req.slot, have + i, b) for i, b in enumerate(new)]
        return True

    def _preempt(self, req: Request) -> None:
        """Recompute: blocks and batch slot back; prefilled again later with its prompt and its emitted tokens."""
        # (the step in flight has only decoding requests, whose emitted tokens a recompute needs: step drains it
        # before a step that might preempt one; a prompt's chunk may preempt a later prompt meanwhile)
        assert self.pending is None or req.prefilling, "a decoding request preempted while its step is in flight"
        self.running.remove(req)
        self.blocks.release(req.rid, self._cached(req))
        self.runner.preempt(req)
        req.resumed, req.prefilled, req.n = len(req.out), 0, 0
        req.preemptions += 1
        self.waiting.appendleft(req)  # victims are taken from the end of `running`: their order is kept

    @staticmethod
    def _cached(req: Request) -> list[int]:
        """The tokens whose KV req's blocks hold: its first n of prompt and output (with overlap a step in flight
        may have written a slot whose token the host has not read yet: that slot is left out)."""
        return (req.prompt + req.out)[:req.n]

    def _schedule(self) -> tuple[list[tuple[Request, int]], list[Request], int]:
        """This step's prompt chunks (request, tokens) and decoding requests, and how many were preempted."""
        budget, reserve = self.max_num_tokens, self.runner.reserve
        chunks: list[tuple[Request, int]] = []
        decodes: list[Request] = []
        preempted = 0
        owned = self.blocks.owned
        prompts: list[Request] = []  # the running requests still prefilling, in order
        for req in list(self.running):  # 1. every request past its prompt decodes
            if req.slot < 0:  # preempted just now
                continue
            if req.prefilling:  # not ready
                prompts.append(req)
                continue
            if req.n + reserve <= KV_BLOCK * len(owned[req.rid]):  # most steps: its blocks hold the step
                decodes.append(req)
                continue
            while not self._grow(req, req.n + reserve):
                victim = self.running[-1]  # joined last, not scheduled yet (or req itself)
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    break
            else:
                decodes.append(req)
        if decodes:  # the speculation policy's tree for this step: the rows each decoding request adds
            self.decode_rows = self.runner.plan(decodes)
            budget -= len(decodes) * self.decode_rows
        for req in prompts:  # 2. the running prompts, in order, while the budget lasts
            if budget <= 0:
                break
            if req.slot < 0:  # preempted by an earlier one's chunk (or while the decodes were scheduled)
                continue
            c = min(budget, req.seq_len - req.prefilled)
            while not self._grow(req, req.prefilled + c):
                victim = self.running[-1]
                if victim is not req and victim.prefilling:  # a later prompt, nothing scheduled for it
                    self._preempt(victim)
                    preempted += 1
                    continue
                c = min(c, (self.blocks.held(req.rid) + len(self.blocks.free)) * KV_BLOCK - req.prefilled)
                if c <= 0:  # as much as the free blocks hold, or nothing
                    break
            if c <= 0:
                break  # the pool is full: the later prompts wait too
            chunks.append((req, c))
            budget -= c
        while self.waiting and len(self.running) < self.max_batch and budget > 0:  # 3. joins
            req = self.waiting[0]
            if not self.blocks.can_allocate(req.seq_len + reserve if self.runner.grows else
                                            self.runner.slots_for(req.prompt, req.max_new_tokens)):
                break  # waits for blocks that running requests will free
            self.runner.queued = len(self.waiting)  # the load it joins (a speculative runner decides by it)
            self.waiting.popleft()
            # its prompt's start from the prefix cache, if there (none without one), where its runner lets it
            # start so (AR's; a speculative method's request that decodes as AR's)
            cached = self.blocks.match(req.rid, req.chunk(req.seq_len) if self.runner.shares_prefix(req) else [])
            req.prefilled = req.n = KV_BLOCK * len(cached)
            req.stats.cached_tokens += req.prefilled
            if not self.runner.grows:  # every block it can ever use, now
                self.blocks.grow(req.rid, self.runner.slots_for(req.prompt, req.max_new_tokens))
            self.runner.join(req, self.blocks.owned[req.rid])
            self.running.append(req)
            c = min(budget, req.seq_len - req.prefilled)
            assert self._grow(req, req.prefilled + c)
            chunks.append((req, c))
            budget -= c
        self.runner.map_blocks(self._updates)
        self._updates = []
        self.runner.queued = len(self.waiting)  # the load behind the batch (a speculative runner plans by it)
        return chunks, decodes, preempted

    def step(self) -> list[tuple[Request, list[int]]]:
        """One boundary and one step. Returns each request's newly emitted tokens (a finished request's last
        ones included; `req.done` says it ended).

        With overlap, step N + 1 is scheduled and launched before step N's tokens are read (SGLang's overlap
        scheduler, vLLM's async scheduling): lengths are known without the tokens (one per decoding request, a
        chunk's per prompt), and a decode row's input token is taken on the device from step N's output (a prompt's
        first token too). Then the host waits for step N's tokens (copied to pinned memory behind it) and emits
        them (EOS, max tokens, finish) while N + 1 runs: this call returns step N's tokens. A request that finished
        at step N already has a row in N + 1: that token is dropped, its blocks go back once N is read (the GPU
        runs its steps in order, so a later owner's writes come after); so is the token in flight of a request
        cancelled meanwhile (it keeps the tokens it was given). A step whose decodes might not get their blocks
        (fewer free than running requests) drains the step in flight first: a preemption recomputes a request from
        its emitted tokens, so they must all be in. A step the runner cannot launch so (runner.overlappable: a
        speculative round, whose input is N's tokens and whose lengths are its own accepted ones; a speculative pass
        with prompt chunks) reads N first, drops the requests N finished, and runs synchronously: the call returns
        both steps' tokens, a request's together."""
        t0 = time.perf_counter()
        drained: list[tuple[Request, list[int]]] = []  # the step in flight's tokens (overlap)
        emitted: list[tuple[Request, list[int]]] = []  # this step's own (synchronous)
        if self.pending and len(self.blocks.free) < len(self.running):
            drained += self.drain()
        self._boundary()
        with self.lock:
            chunks, decodes, preempted = self._schedule()
        rec = StepRecord(len(decodes), [c for _, c in chunks], len(decodes) * self.decode_rows +
                         sum(c for _, c in chunks), preempted, len(self.running), len(self.waiting),
                         self.decode_rows if decodes else 0)
        rec.start, rec.plan_s = t0, time.perf_counter() - t0
        if self.overlap and (chunks or decodes) and self.runner.overlappable(chunks, decodes):
            rec.events = self._events()
            t_start = time.perf_counter()
            rows, tokens, event = self._launch(chunks, decodes)
            if rec.events:
                rec.events[1].record()
            t1 = time.perf_counter()
            rec.launch_s = t1 - t_start
            drained += self.drain()  # step N's tokens, while this one runs
            for req, c in chunks:  # lengths advance now (after N's emission, which reads them); tokens next step
                if not req.done:  # (failed)
                    req.prefilled = req.n = req.prefilled + c
                    if not req.prefilling:
                        req.last = -1
            for r in decodes:
                if not r.done:  # (finished at N: its row's token is dropped)
                    r.n += 1
                    r.last = -1
            self.pending = Pending(chunks, rows, tokens, event, t_start, t1)
        elif chunks or decodes:
            if self.pending:  # a step that needs the tokens in flight (a speculative round): they are read first
                drained += self.drain()
                decodes = [r for r in decodes if not r.done]  # finished at that step: nothing more to decode
            events = self._events()
            t1 = time.perf_counter()
            firsts, decoded = self._run(chunks, decodes)  # its tokens read back: the pass is over
            now = self.t_done = time.perf_counter()  # when every token of this step was emitted
            dt = now - t1  # the one pass counts for every request in it, as its phase
            if events:
                events[1].record()
                rec.events = events
            for (req, _), first in zip(chunks, firsts):
                req.stats.prefill_s += dt
                if first is not None:
                    req.t_first = req.t_first or now  # a recomputed request had its first token
                    emitted.append((req, self._emit(req, first, now)))
            for req, toks in zip(decodes, decoded):
                req.stats.decode_s += dt
                emitted.append((req, self._emit(req, toks, now)))
        else:
            drained += self.drain()
        rec.step_s = time.perf_counter() - t0
        self.history.append(rec)
        if drained and emitted:  # a synchronous step after an overlapped one: a request once, as serving expects
            merged: dict[Request, list[int]] = {}
            for req, toks in drained + emitted:
                merged[req] = merged.get(req, []) + toks
            return list(merged.items())
        return drained or emitted

    def _events(self) -> tuple | None:
        """CUDA events around a pass (timing on), the first recorded now."""
        if not (self.timing and self.runner.device.type == "cuda"):
            return None
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        return events

    def drain(self) -> list[tuple[Request, list[int]]]:
        """The step in flight's tokens read (waits for them) and emitted; a request that finished or left since it
        was launched drops its token. Nothing in flight: nothing. Also for a caller that stops between steps and
        wants every token made (distill's --time-limit)."""
        p, self.pending = self.pending, None
        if p is None:
            return []
        if p.event is not None:
            p.event.synchronize()
        now = time.perf_counter()
        # the step's own time: the device ran it after what it had before (read at t_done) or from its launch,
        # whichever came later (so a gap with nothing to run is not counted); in a stream of overlapped steps,
        # one read to the next. On the CPU (no event) the launch ran the step: its time is the launch's. It is
        # what the step's requests count as their phase's time too: launch to read spans the step before it as
        # well (its launch comes before that one is read), which counted each step twice on the GPU (an AR
        # answer's decode_s 1.8x its wall time on the H100 at 1cd19b9)
        took = now - max(p.t_start, self.t_done) if p.event is not None else p.t_launch - p.t_start
        self.t_done = now
        for req, _ in p.chunks:
            req.stats.prefill_s += took
        emitted, kept = [], []  # kept: the decode rows whose token is their request's
        for (req, first), tok in zip(p.rows, p.tokens.tolist()):
            # finished at the step before, or cancelled since (a step that drains first does so before the
            # boundary that lets a cancelled request go): its row's token is not its
            if req.done or req.cancelled:
                continue
            req.last = tok
            if first:
                req.t_first = req.t_first or now  # a recomputed request had its first token
            else:
                req.stats.decode_s += took
                kept.append(req)
            emitted.append((req, self._emit(req, [tok], now)))
        # a step none of whose rows is kept ran for requests that had finished: nothing waited for it, so it may
        # have been read long after it ended (the next request's first step, after an idle engine): no time
        self.runner.read(kept, took if kept else None)
        return emitted

    def _launch(self, chunks: list[tuple[Request, int]], decodes: list[Request]):
        """The step launched (overlap), failed chunks as in `_run`."""
        return self._guarded(self.runner.step_async, chunks, decodes)[0]

    def _run(self, chunks: list[tuple[Request, int]], decodes: list[Request]):
        """The step's pass: each chunk's first token (None where it has none) and the decodes' tokens."""
        out, ok = self._guarded(self.runner.step, chunks, decodes)
        return out if ok else ([None] * len(chunks), out[1])

    def _guarded(self, run, chunks: list[tuple[Request, int]], decodes: list[Request]):
        """run(chunks, decodes), and whether it ran as asked. One that fails fails the requests whose prompt chunks
        were in it (their input is what is new); the decodes run again without them and the batch goes on."""
        try:
            return run(chunks, decodes), True
        except Exception as e:
            if not chunks:
                raise
            for req, _ in chunks:
                self._fail(req, e)
            return run([], decodes), False

    def _fail(self, req: Request, e: Exception) -> None:
        req.error = f"{type(e).__name__}: {e}"
        self._finish(req, "error")

    def _emit(self, req: Request, toks: list[int], now: float) -> list[int]:
        """Cut at EOS or the budget (run for every request every step: kept lean)."""
        if len(toks) == 1:  # AR: one token (room >= 1: a request with no room has finished)
            stop = 0 if toks[0] in self.stop_ids else None
        else:
            room = req.max_new_tokens - len(req.out)
            stop = next((i for i, t in enumerate(toks[:room]) if t in self.stop_ids), None)
            toks = toks[: stop + 1] if stop is not None else toks[:room]
        out = req.out
        out += toks
        req.stats.new_tokens = len(out)
        if toks:
            req.emits.append((now, len(toks)))
        if stop is not None or len(out) >= req.max_new_tokens:
            self._finish(req, "eos" if stop is not None else "max_tokens")
        elif req.n + self.runner.reserve >= self.max_seq_len:  # no room for another step: the
            self._finish(req, "length")
        return toks

    def run(self, requests: list[Request]) -> None:
        """Step until every given request is done."""
        while not all(r.done for r in requests):
            self.step()
