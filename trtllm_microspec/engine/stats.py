"""Per-request statistics of a generation."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # target forward passes after prefill (decode steps for AR, draft/verify rounds otherwise)
    # per round, kept on the device during generation and read once at the end
    vocab_sizes: list = field(default_factory=list)  # active draft vocabulary size
    covered: list = field(default_factory=list)  # emitted tokens that were in that round's draft vocabulary
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    vocab_s: float = 0.0
    wall_s: float = 0.0
    stop_reason: str = ""

    def gather_device_counters(self) -> None:
        if self.vocab_sizes and not isinstance(self.vocab_sizes[0], int):
            self.vocab_sizes = torch.stack(self.vocab_sizes).tolist()
            self.covered = torch.stack(self.covered).tolist()

    def summary(self) -> dict:
        d = asdict(self)
        sizes = d.pop("vocab_sizes")
        d["acceptance_length"] = (self.new_tokens - 1) / self.rounds if self.rounds else 0.0
        d["vocab_mean"] = sum(sizes) / len(sizes) if sizes else 0.0
        d["vocab_max"] = max(sizes) if sizes else 0
        emitted = self.new_tokens - 1  # the first token comes from prefill, not from a draft round
        d.pop("covered")
        d["coverage"] = min(1.0, sum(self.covered) / emitted) if sizes and emitted > 0 else None
        d["tokens_per_s"] = self.new_tokens / self.wall_s if self.wall_s else 0.0
        return d
