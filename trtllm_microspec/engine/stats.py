"""Per-request statistics of a generation."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (a resumed request's again too)
    new_tokens: int = 0
    rounds: int = 0  # draft/verify rounds (0 for AR)
    round_tokens: int = 0  # tokens the rounds emitted (accepted + bonus), before EOS / budget truncation
    vocab_sum: int = 0  # active draft vocabulary size, summed over rounds
    vocab_max: int = 0
    covered: int = 0  # emitted tokens that were in their round's draft vocabulary
    # batched engine: steps per tree size the speculation policy chose (1: a plain decode step, not a round)
    tree_sizes: dict = field(default_factory=dict)
    # its plain steps by why the speculation policy ran them plain (engine/policy.py PLAIN_REASONS)
    plain_reasons: dict = field(default_factory=dict)
    # batched engine, a speculative method: whether the request speculated (True), or decoded as AR's to its end
    # (False: it asked not to, or no tree paid at the batch it joined: SpecRunner.shares_prefix); None: AR, or not
    # through the batched engine
    speculative: bool | None = None
    prefill_s: float = 0.0  # target prefill (+ top-K_pre, window start and draft prefill)
    # the engine runs a round as one launch (one CUDA graph): a request has decode_s (the steps it took part in)
    # and None for the three phases (kept for readers of the statistics; the profile splits the phases)
    draft_s: float | None = 0.0  # drafting the tree (depth + 1 draft forwards and head calls)
    verify_s: float | None = 0.0  # target pass over the tree, acceptance, KV compaction (AR: the decode steps)
    update_s: float | None = 0.0  # window update + gather (copy stream) overlapped with the draft's catch-up forward
    decode_s: float | None = None  # every decode step or round (None: the sum of the three phases)
    wall_s: float = 0.0
    stop_reason: str = ""

    def summary(self) -> dict:
        d = asdict(self)
        if self.decode_s is None:
            d["decode_s"] = self.draft_s + self.verify_s + self.update_s
        # over speculative rounds only: None with none (no acceptance of 0 for rounds that did not run)
        d["acceptance_length"] = self.round_tokens / self.rounds if self.rounds else None
        d["vocab_mean"] = self.vocab_sum / self.rounds if self.rounds else None
        d["vocab_max"] = self.vocab_max if self.rounds else None
        d["coverage"] = self.covered / self.round_tokens if self.round_tokens else None
        d["plain_steps"] = sum(self.plain_reasons.values())
        d["tokens_per_s"] = self.new_tokens / self.wall_s if self.wall_s else 0.0
        return d


def percentiles(xs: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict:
    """{"p50": ..., "p90": ..., "p99": ...} (linear interpolation); None each when there is nothing to rank."""
    return {f"p{q}": float(np.percentile(xs, q)) if xs else None for q in qs}


# ---- per-request timing under load: one definition for our engine and for the outside references (bench
# --concurrency). A request is (submit, emits): the time it was submitted, i.e. handed to the system by its caller
# (queueing for a batch slot comes after it), and the (time, tokens) of each step that emitted any of its tokens, the
# time when they reached the host; every time on one clock (time.perf_counter).

def inter_token_gaps(emits: list[tuple[float, int]]) -> list[float]:
    """Inter-token latencies: one value per token after the request's first, the time between the step that emitted
    it and the request's previous emitting step, shared by the tokens of the later step (a speculative round emits
    several at once)."""
    return [(t - t0) / k for (t0, _), (t, k) in zip(emits, emits[1:]) for _ in range(k)]


def request_times(submit: float, emits: list[tuple[float, int]]) -> dict:
    """One request's times from its submission: ttft_s = its first token's time - submit (queueing, prefill
    included), latency_s = its last token's time - submit, inter_token_s = `inter_token_gaps`; None (and no gaps)
    for a request that emitted nothing."""
    if not emits:
        return {"ttft_s": None, "latency_s": None, "inter_token_s": []}
    if emits[0][0] < submit:
        raise ValueError(f"a token at {emits[0][0]} before its request's submission at {submit}: not one clock")
    return {"ttft_s": emits[0][0] - submit, "latency_s": emits[-1][0] - submit,
            "inter_token_s": inter_token_gaps(emits)}


def load_times(requests: list[tuple[float, list[tuple[float, int]]]]) -> tuple[dict, list[dict]]:
    """Requests [(submit, emits)] -> ({"ttft_s", "itl_s", "latency_s"}: percentiles over the requests (ITL: over
    every token after a first, all requests pooled), [request_times of each])."""
    each = [request_times(s, e) for s, e in requests]
    return {"ttft_s": percentiles([r["ttft_s"] for r in each if r["ttft_s"] is not None]),
            "itl_s": percentiles([x for r in each for x in r["inter_token_s"]]),
            "latency_s": percentiles([r["latency_s"] for r in each if r["latency_s"] is not None])}, each
