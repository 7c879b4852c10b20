"""In-flight batching: requests join and leave a running batch at step boundaries.

`Scheduler.step()` is one boundary plus one step: finished and cancelled requests leave (their blocks go back
at once), waiting requests join in order while the batch has room and the pool has their blocks (the first
that does not fit holds the rest back, so a long request is not starved by short ones), prefill advances by
at most PREFILL_BUDGET prompt tokens (chunked: a long prompt does not stall the running batch for more than
one chunk per step; the chunks of several requests go through one target pass), and every request whose prompt
is in the cache decodes one step together (one target pass for the batch). Each request samples with its own
SamplingParams (greedy by default): its tokens are those it gets alone with the same parameters and seed.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..models.registry import UserError
from ..spec.sampling import GREEDY, SamplingParams
from .block_manager import BlockManager
from .stats import Stats

PREFILL_BUDGET = 512  # prompt tokens prefilled per step, over all joining requests


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = GREEDY
    rid: int = field(default_factory=itertools.count().__next__)
    out: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache
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

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def inter_token_s(self) -> list[float]:
        """Inter-token latencies: the time between two emitting steps, shared by the tokens the later one emitted
        (a speculative round emits several at once), so there is one value per token after the first."""
        return [(t - t0) / k for (t0, _), (t, k) in zip(self.emits, self.emits[1:]) for _ in range(k)]


class Scheduler:
    def __init__(self, runner, max_batch: int):
        if max_batch < 1:
            raise UserError(f"max_batch must be at least 1, got {max_batch}")
        self.runner, self.max_batch = runner, max_batch
        self.blocks: BlockManager = runner.blocks
        self.stop_ids = set(runner.stop_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Lock()  # add / cancel may come from other threads (serving)

    def add(self, prompt: list[int], max_new_tokens: int, params: SamplingParams = GREEDY) -> Request:
        """Queue a request; a UserError now if it could never run."""
        self.runner.check(prompt, max_new_tokens)
        self.blocks.check(self.runner.slots_for(prompt, max_new_tokens), "this request")
        req = Request(prompt=list(prompt), max_new_tokens=max_new_tokens, params=params)
        req.stats.prompt_tokens = len(prompt)
        # a step's time counts for every request in it; a round's phases run as one launch: not split
        req.stats.decode_s, req.stats.draft_s, req.stats.verify_s, req.stats.update_s = 0.0, None, None, None
        with self.lock:
            self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """The request leaves at the next step boundary; its blocks go back then."""
        req.cancelled = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _finish(self, req: Request, reason: str) -> None:
        req.done = True
        req.stats.stop_reason = reason
        req.stats.wall_s = time.perf_counter() - req.t_submit
        self.blocks.release(req.rid)
        self.runner.leave(req)

    def _boundary(self) -> None:
        for req in [r for r in self.running if r.cancelled or r.done]:
            self.running.remove(req)
            if not req.done:
                self._finish(req, "cancelled")
        with self.lock:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                req.done, req.stats.stop_reason = True, "cancelled"
            while self.waiting and len(self.running) < self.max_batch:
                req = self.waiting[0]
                slots = self.runner.slots_for(req.prompt, req.max_new_tokens)
                if not self.blocks.can_allocate(slots):
                    break  # waits for blocks that running requests will free
                self.waiting.popleft()
                self.runner.join(req, self.blocks.allocate(req.rid, slots))
                self.running.append(req)

    def step(self) -> list[tuple[Request, list[int]]]:
        """One boundary and one step. Returns each request's newly emitted tokens (a finished request's last
        ones included; `req.done` says it ended)."""
        self._boundary()
        emitted: list[tuple[Request, list[int]]] = []
        budget, chunks = PREFILL_BUDGET, []
        for req in [r for r in self.running if r.prefilling]:
            if budget <= 0:
                break
            rest = len(req.prompt) - req.prefilled
            chunk = min(budget, rest)
            budget -= chunk
            chunks.append((req, chunk))
        if chunks:
            t0 = time.perf_counter()
            try:
                firsts = self.runner.prefill(chunks)  # one pass for all of them (its first tokens read back)
            except Exception as e:  # these requests fail, the batch goes on
                firsts = [None] * len(chunks)
                for req, _ in chunks:
                    self._fail(req, e)
            dt = time.perf_counter() - t0
            for (req, _), first in zip(chunks, firsts):
                req.stats.prefill_s += dt
                if first is not None:
                    req.t_first = time.perf_counter()
                    emitted.append((req, self._emit(req, first)))
        just = {r.rid for r, _ in emitted}  # their first token came from the prefill: they decode next step
        ready = [r for r in self.running if r.out and not r.done and r.rid not in just]
        if ready:
            t0 = time.perf_counter()
            outs = self.runner.decode(ready)  # its tokens read back: the step is over
            dt = time.perf_counter() - t0
            for req, toks in zip(ready, outs):
                req.stats.decode_s += dt
                emitted.append((req, self._emit(req, toks)))
        return emitted

    def _fail(self, req: Request, e: Exception) -> None:
        req.error = f"{type(e).__name__}: {e}"
        self._finish(req, "error")

    def _emit(self, req: Request, toks: list[int]) -> list[int]:
        """Cut at EOS or the budget, as the single-request executor does."""
        room = req.max_new_tokens - len(req.out)
        stop = next((i for i, t in enumerate(toks[:room]) if t in self.stop_ids), None)
        toks = toks[: stop + 1] if stop is not None else toks[:room]
        req.out += toks
        req.stats.new_tokens = len(req.out)
        if toks:
            req.emits.append((time.perf_counter(), len(toks)))
        if stop is not None or len(req.out) >= req.max_new_tokens:
            self._finish(req, "eos" if stop is not None else "max_tokens")
        elif req.n + self.runner.reserve >= self.runner.target.cfg.max_seq_len:  # no room for another step: the
            self._finish(req, "length")  # single-request executor's rule, so the same tokens
        return toks

    def run(self, requests: list[Request]) -> None:
        """Step until every given request is done."""
        while not all(r.done for r in requests):
            self.step()
