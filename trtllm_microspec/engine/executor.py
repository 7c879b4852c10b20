"""The generation loop for one request: prefill, then AR decode steps or EAGLE-2 draft/verify rounds.

`Executor.run` is a generator: it yields the tokens emitted by each step (so callers can stream) and returns
the request's Stats. Greedy (temperature 0), the speculative output is token for token the AR output; sampled, it
is distributed as AR sampling (spec/sampling.py).

Device state lives in persistent tensors (`n` = committed length, `root`, `h_last`, the counters), updated
in place by three phases per round -- draft, verify, update -- so the round has no host synchronisation but
the one read of the emitted tokens, and on CUDA each phase is captured in a graph per KV-length bucket.
"""
from __future__ import annotations

import time
from collections.abc import Generator

import torch

from ..models.model import Span, Transformer
from ..models.registry import UserError
from ..spec.sampling import GREEDY, Sampler, SamplingParams
from ..spec.tree import TreeConfig, accept, causal, draft_tree, verify
from .graphs import GraphRunner, bucket_for
from .stats import Stats

PREFILL_CHUNK = 512  # prompt rows per LM-head call when collecting top-K_pre (never [L x V] at once)


def round_reserve(tree: TreeConfig | None) -> int:
    """Cache slots a step may write past the committed length: a speculative round's tree, compacted path and
    draft expansions; an AR step its one token (tree None)."""
    return max(tree.total_tokens, tree.max_path + tree.draft_slots) if tree else 1


def check_request(prompt_ids: list[int], max_new_tokens: int, max_seq_len: int, vocab_size: int,
                  reserve: int) -> None:
    """The one rule for a request, on every path (the single-request executor, the batched engine, serving): a
    prompt leaves room for one step (`reserve` slots) and its first token within max_seq_len."""
    if not prompt_ids:
        raise UserError("the prompt is empty")
    if max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be positive, got {max_new_tokens}")
    limit = max_seq_len - reserve - 1
    if len(prompt_ids) > limit:
        room = "one speculative round (its draft tree) and" if reserve > 1 else "one decode step and"
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; this engine accepts at most {limit}: max_seq_len "
                        f"{max_seq_len} less {reserve + 1} cache slots of room for {room} the next token")
    if max(prompt_ids) >= vocab_size or min(prompt_ids) < 0:
        raise UserError("the prompt has token ids outside the vocabulary")


class PhaseTimer:
    """Accumulates time per phase; on CUDA with events, read once at the end (no sync inside the loop)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, object, object]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def run(self, name: str, fn) -> None:
        start = self._now()
        fn()
        self.spans.append((name, start, self._now()))

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for name, a, b in self.spans:
            out[name] = out.get(name, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


class Executor:
    def __init__(self, target: Transformer, draft=None, vocab=None, tree: TreeConfig = TreeConfig(),
                 k_pre: int = 3, k_ver: int = 3, cuda_graphs: bool = False):
        self.target, self.draft, self.vocab, self.tree = target, draft, vocab, tree
        self.k_pre, self.k_ver = k_pre, k_ver
        dev = self.device = target.cache.k.device
        self.stop_ids = set(target.cfg.eos_ids)
        self.reserve = round_reserve(tree if draft else None)
        self.graphs = GraphRunner() if cuda_graphs else None
        # persistent device state, updated in place by the phases
        self.n = torch.zeros((), dtype=torch.long, device=dev)
        self.root = torch.zeros(1, dtype=torch.long, device=dev)
        self.h_last = torch.zeros((draft or target).cfg.hidden_size, dtype=target.cache.k.dtype, device=dev)
        self.counters = torch.zeros(3, dtype=torch.long, device=dev)  # vocab size sum, vocab size max, covered
        self.steps = torch.arange(tree.max_path, device=dev)
        # what the host reads after a round: [k, emitted...]; persistent, since the round's other tensors
        # belong to whichever bucket's graphs ran
        self.out = torch.zeros(tree.max_path + 1, dtype=torch.long, device=dev)
        # uniforms per step: one per tree level; AR one, whatever the tree knobs
        self.sampler = Sampler(target.argmax, dev, tree.max_path if draft else 1)

    @property
    def max_prompt(self) -> int:
        return self.target.cfg.max_seq_len - self.reserve - 1

    def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        check_request(prompt_ids, max_new_tokens, self.target.cfg.max_seq_len, self.target.cfg.vocab_size,
                      self.reserve)

    def run(self, prompt_ids: list[int], max_new_tokens: int,
            sampling: SamplingParams = GREEDY) -> Generator[list[int], None, Stats]:
        self.check(prompt_ids, max_new_tokens)
        self.sampler.start(0, sampling, self.target.cfg.vocab_size)
        self.mode = self.sampler.mode([0])
        stats, timer = Stats(prompt_tokens=len(prompt_ids)), PhaseTimer(self.device)
        t0 = time.perf_counter()
        self.counters.zero_()
        steps = self._speculative(prompt_ids, stats, timer) if self.draft else self._autoregressive(prompt_ids, timer)
        for toks in steps:
            room = max_new_tokens - stats.new_tokens
            stop = next((i for i, t in enumerate(toks[:room]) if t in self.stop_ids), None)
            toks = toks[: stop + 1] if stop is not None else toks[:room]
            stats.new_tokens += len(toks)
            end_now = yield toks  # a caller may send(True) to end early (a stop word) and still get the stats
            if stop is not None or stats.new_tokens >= max_new_tokens or end_now:
                stats.stop_reason = ("eos" if stop is not None else "max_tokens" if stats.new_tokens >= max_new_tokens
                                     else "stopped")
                break
        else:
            stats.stop_reason = "length"
        for name, s in timer.totals().items():
            setattr(stats, f"{name}_s", s)
        stats.vocab_sum, stats.vocab_max, stats.covered = self.counters.tolist()
        stats.wall_s = time.perf_counter() - t0
        return stats

    def choose(self, logits: torch.Tensor, level) -> torch.Tensor:
        return self.sampler.choose(logits, 0, level, self.mode)  # the one request is the sampler's row 0

    def _phase(self, timer: PhaseTimer, name: str, S: int, fn) -> None:
        timer.run(name, (lambda: self.graphs(name, (S, self.mode), fn)) if self.graphs else fn)

    def _span(self, n: int) -> int:
        """KV slots the next step attends over: just enough eagerly, a fixed bucket under CUDA graphs."""
        need = n + self.reserve
        if not self.graphs:
            return need
        S = bucket_for(need, self.target.cfg.max_seq_len)
        self.graphs.begin_round((S, self.mode))  # greedy and sampling steps are different graphs
        return S

    def _prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(prompt_ids, device=self.device)
        L = ids.numel()
        pos = torch.arange(L, device=self.device)
        self.n.fill_(0)
        h = self.target(ids, pos, pos, Span(self.n, causal(L, self.device), L))
        self.n.fill_(L)
        return ids, h

    def _autoregressive(self, prompt_ids, timer) -> Generator[list[int], None, None]:
        t = self.target

        def prefill():
            _, h = self._prefill(prompt_ids)
            self.root.copy_(self.choose(t.logits(h[-1:]), 0))

        def step(S):
            h = t(self.root, self.n.view(1), self.n.view(1), Span(self.n, causal(1, self.device), S))
            self.root.copy_(self.choose(t.logits(h), 0))
            self.n.add_(1)

        self.sampler.next([0])
        timer.run("prefill", prefill)
        n = len(prompt_ids)
        yield self.root.tolist()
        while n + self.reserve < t.cfg.max_seq_len:
            S = self._span(n)
            self.sampler.next([0])
            self._phase(timer, "verify", S, lambda: step(S))
            n += 1
            yield self.root.tolist()  # the one host read per step

    def _speculative(self, prompt_ids, stats: Stats, timer) -> Generator[list[int], None, None]:
        t, d, vocab, cfg, dev = self.target, self.draft, self.vocab, self.tree, self.device
        P = cfg.max_path

        def prefill():
            ids, h = self._prefill(prompt_ids)
            first = t.logits(h[-1:])
            self.root.copy_(self.choose(first, 0))
            topk_pre = torch.cat([t.topk(t.logits(h[i:i + PREFILL_CHUNK]), self.k_pre).flatten()
                                  for i in range(0, h.shape[0], PREFILL_CHUNK)])
            vocab.start(ids, topk_pre, t.topk(first, self.k_ver)[0])
            L = ids.numel()
            pos = torch.arange(L, device=dev)
            zero = torch.zeros((), dtype=torch.long, device=dev)
            dh = d(torch.cat([ids[1:], self.root]), d.features(h), pos, pos, Span(zero, causal(L, dev), L))
            self.h_last.copy_(dh[-1])
            vocab.join()

        def draft_phase(S):
            self.drafted = draft_tree(d, vocab, self.h_last, self.root, self.n, S, cfg,
                                      self.sampler.draft_temperature(0, self.mode))

        def verify_phase(S):
            hid, logits = verify(t, self.drafted, self.n, S)
            # greedy: the argmax of every node; sampling: one draw per node, which is EAGLE's recursive rejection
            self.path, self.k, self.emitted = accept(self.drafted, self.choose(logits, self.drafted.depth), P)
            self.out.copy_(torch.cat([self.k.view(1), self.emitted]))
            self.hid_path = d.features(hid)[self.path]
            ver = t.topk(logits[self.path], self.k_ver)
            self.ver = torch.where((self.steps <= self.k)[:, None], ver, -1).flatten()
            t.cache.move(self.n + self.path, self.n + self.steps)

        def update_phase(S):
            valid = self.steps <= self.k
            size = vocab.size()
            self.counters += torch.stack([size, torch.zeros_like(size), (vocab.contains(self.emitted) & valid).sum()])
            self.counters[1] = torch.maximum(self.counters[1], size)
            vocab.update(self.drafted.tokens[1:], self.ver)  # the gather runs on the copy stream ...
            pos = self.n + self.steps
            h = d(self.emitted, self.hid_path, pos, pos, Span(self.n, causal(P, dev), S))
            last = self.k.view(1)
            self.h_last.copy_(h.index_select(0, last)[0])  # ... hidden behind this draft forward
            self.root.copy_(self.emitted.index_select(0, last))
            self.n.add_(self.k + 1)
            vocab.join()

        self.sampler.next([0])
        timer.run("prefill", prefill)
        n = len(prompt_ids)
        yield self.root.tolist()
        while n + self.reserve < t.cfg.max_seq_len:
            S = self._span(n)
            self.sampler.next([0])
            self._phase(timer, "draft", S, lambda: draft_phase(S))
            self._phase(timer, "verify", S, lambda: verify_phase(S))
            self._phase(timer, "update", S, lambda: update_phase(S))
            k, *out = self.out.tolist()  # the one host read per round
            stats.rounds += 1
            stats.round_tokens += k + 1
            n += k + 1
            yield out[: k + 1]
