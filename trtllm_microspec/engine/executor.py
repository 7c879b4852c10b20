"""The generation loop for one request: prefill, then AR decode steps or EAGLE-2 draft/verify rounds.

`Executor.run` is a generator: it yields the tokens emitted by each step (so callers can stream) and returns
the request's Stats. Greedy only; the speculative output is token for token the AR output.
"""
from __future__ import annotations

import time
from collections.abc import Generator

import torch

from ..models.model import Transformer
from ..models.registry import UserError
from ..spec.tree import TreeConfig, accept, causal_mask, draft_tree, verify
from .stats import Stats

PREFILL_CHUNK = 512  # prompt rows per LM-head call when collecting top-K_pre (never [L x V] at once)


class PhaseTimer:
    """Accumulates time per phase; on CUDA with events, read once at the end (no sync inside the loop)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, object, object]] = []

    def __call__(self, name: str):
        return _Span(self, name)

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.cuda:
            torch.cuda.synchronize()
        for name, a, b in self.spans:
            out[name] = out.get(name, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


class _Span:
    def __init__(self, timer: PhaseTimer, name: str):
        self.t, self.name = timer, name

    def _now(self):
        if self.t.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def __enter__(self):
        self.start = self._now()

    def __exit__(self, *exc):
        self.t.spans.append((self.name, self.start, self._now()))


class Executor:
    def __init__(self, target: Transformer, draft=None, vocab=None, tree: TreeConfig = TreeConfig(),
                 k_pre: int = 3, k_ver: int = 3):
        self.target, self.draft, self.vocab, self.tree = target, draft, vocab, tree
        self.k_pre, self.k_ver = k_pre, k_ver
        self.device = target.cache.k.device
        self.stop_ids = set(target.cfg.eos_ids)
        # cache slots a step may write past the committed length
        self.reserve = max(tree.total_tokens, tree.max_path + tree.draft_slots) if draft else 1

    @property
    def max_prompt(self) -> int:
        return self.target.cfg.max_seq_len - self.reserve - 1

    def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise UserError("the prompt is empty")
        if max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if len(prompt_ids) > self.max_prompt:
            raise UserError(f"the prompt has {len(prompt_ids)} tokens; this engine accepts at most "
                            f"{self.max_prompt} (max_seq_len {self.target.cfg.max_seq_len})")
        if max(prompt_ids) >= self.target.cfg.vocab_size or min(prompt_ids) < 0:
            raise UserError("the prompt has token ids outside the vocabulary")

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> Generator[list[int], None, Stats]:
        self.check(prompt_ids, max_new_tokens)
        stats, timer = Stats(prompt_tokens=len(prompt_ids)), PhaseTimer(self.device)
        t0 = time.perf_counter()
        steps = self._speculative(prompt_ids, stats, timer) if self.draft else self._autoregressive(prompt_ids, timer)
        for toks in steps:
            room = max_new_tokens - stats.new_tokens
            stop = next((i for i, t in enumerate(toks[:room]) if t in self.stop_ids), None)
            toks = toks[: stop + 1] if stop is not None else toks[:room]
            stats.new_tokens += len(toks)
            yield toks
            if stop is not None or stats.new_tokens >= max_new_tokens:
                stats.stop_reason = "eos" if stop is not None else "max_tokens"
                break
        else:
            stats.stop_reason = "length"
        for name, s in timer.totals().items():
            setattr(stats, f"{name}_s", s)
        stats.gather_device_counters()
        stats.wall_s = time.perf_counter() - t0
        return stats

    def _prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(prompt_ids, device=self.device)
        L = ids.numel()
        pos = torch.arange(L, device=self.device)
        return ids, self.target(ids, pos, pos, causal_mask(0, L, self.device))

    def _autoregressive(self, prompt_ids, timer) -> Generator[list[int], None, None]:
        t, dev = self.target, self.device
        with timer("prefill"):
            _, h = self._prefill(prompt_ids)
            tok = t.logits(h[-1:]).argmax(-1)
        n = len(prompt_ids)
        yield [int(tok)]
        while n + self.reserve < t.cfg.max_seq_len:
            with timer("verify"):
                pos = torch.tensor([n], device=dev)
                tok = t.logits(t(tok, pos, pos, causal_mask(n, 1, dev))).argmax(-1)
            n += 1
            yield [int(tok)]

    def _speculative(self, prompt_ids, stats: Stats, timer) -> Generator[list[int], None, None]:
        t, d, vocab, cfg, dev = self.target, self.draft, self.vocab, self.tree, self.device
        with timer("prefill"):
            ids, h = self._prefill(prompt_ids)
            first = t.logits(h[-1:])[0]
            root = first.argmax().view(1)
            topk_pre = torch.cat([t.logits(h[i:i + PREFILL_CHUNK]).topk(self.k_pre, -1).indices.flatten()
                                  for i in range(0, h.shape[0], PREFILL_CHUNK)])
        with timer("vocab"):
            vocab.start(ids, topk_pre, first.topk(self.k_ver).indices)
        with timer("draft"):
            L = ids.numel()
            pos = torch.arange(L, device=dev)
            h_last = d(torch.cat([ids[1:], root]), h, pos, pos, causal_mask(0, L, dev))[-1]
        n = L
        yield [int(root)]
        P = cfg.max_path
        while n + self.reserve < t.cfg.max_seq_len:
            with timer("draft"):
                tree = draft_tree(d, vocab, h_last, root, n, cfg)
            with timer("verify"):
                hid, logits = verify(t, tree, n)
                path, k_dev, emitted = accept(tree, logits.argmax(-1), P)
                k, *out = torch.cat([k_dev.view(1), emitted]).tolist()  # the one host read per round
                out = out[: k + 1]
                stats.covered.append(vocab.contains(emitted[: k + 1]).sum())
                t.cache.move(n + path, n + torch.arange(P, device=dev))
            with timer("vocab"):
                stats.vocab_sizes.append(vocab.size())
                ver = logits[path].topk(self.k_ver, -1).indices
                ver = torch.where((torch.arange(P, device=dev) <= k)[:, None], ver, -1).flatten()
                vocab.update(tree.tokens[1:], ver)
            with timer("draft"):
                pos = n + torch.arange(P, device=dev)
                h_last = d(emitted, hid[path], pos, pos, causal_mask(n, P, dev))[k]
            stats.rounds += 1
            root = emitted[k].view(1)
            n += k + 1
            yield out
