"""`microspec serve --tp N`: the Triton model is rank 0 and N - 1 follower processes run the same steps.

`microspec serve` hosts the group's TCP store and starts the followers (`python -m trtllm_microspec.serving.tp`);
the model joins as rank 0 inside Triton's Python stub. Rank 0 sends the LLM's arguments once; then, before every
step of its batched engine, the requests added and cancelled since the step before (`LeadScheduler`): each rank's
scheduler then decides alike from the same requests and tokens (the speculation policy's tree is rank 0's,
parallel.agree). These messages go over a gloo group of their own with no deadline, since a follower waits for
requests as long as the server is idle; the steps' tensors go over the model's NCCL (gloo on the CPU) collectives,
with --tp-timeout.
"""
from __future__ import annotations

import argparse
import datetime

import torch.distributed as dist

from .. import parallel
from ..engine.loader import pick_device
from ..speculative.sampling import GREEDY

_control = None


def _bcast(obj=None):
    """rank 0's `obj`, on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def join(tp: int, rank: int, port: int, device: str | None, timeout_s: float) -> None:
    """Join the group (the device picked as the LLM picks it: NCCL on CUDA, gloo on the CPU) and its control group."""
    global _control
    parallel.init(tp, pick_device(device or None)[0], timeout_s, rank_port=(rank, port))
    _control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


class LeadScheduler:
    """Rank 0's scheduler: every add and cancel is recorded and sent to the followers before the next step."""

    def __init__(self, sched):
        self.sched, self.events, self.index, self.added = sched, [], {}, 0

    def __getattr__(self, name):  # everything else is the scheduler's own
        return getattr(self.sched, name)

    def add(self, prompt, max_new_tokens, params=GREEDY):
        req = self.sched.add(prompt, max_new_tokens, params)  # a refused request is not sent
        self.index[req] = self.added
        self.added += 1
        self.events.append(("add", list(prompt), max_new_tokens, params))
        return req

    def cancel(self, req) -> None:
        self.sched.cancel(req)
        if req in self.index:
            self.events.append(("cancel", self.index.pop(req)))

    def step(self):
        _bcast(self.events)
        self.events = []
        for req in [r for r in self.index if r.done]:  # over: no cancel of theirs needs sending
            del self.index[req]
        return self.sched.step()

    def run(self, requests) -> None:
        while not all(r.done for r in requests):
            self.step()


def lead(llm_factory, kwargs: dict):
    """Rank 0: send the LLM's arguments, build it, and make its batched engine send every step's requests."""
    _bcast(kwargs)
    llm = llm_factory(**kwargs)
    llm._scheduler = LeadScheduler(llm.scheduler())
    return llm


def stop() -> None:
    """Rank 0: the followers exit (the model unloads)."""
    _bcast(None)


def follow() -> None:
    """Ranks > 0: build the same LLM, then run every step rank 0 runs, with the requests it added and cancelled,
    until it says stop."""
    from ..llm import LLM

    llm = LLM(**_bcast())
    sched, reqs, added = llm.scheduler(), {}, 0
    while (events := _bcast()) is not None:
        for kind, *args in events:
            if kind == "add":
                reqs[added] = sched.add(*args)
                added += 1
            elif (req := reqs.pop(args[0], None)) is not None:
                sched.cancel(req)
        for i in [i for i, r in reqs.items() if r.done]:
            del reqs[i]
        sched.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="")
    p.add_argument("--tp-timeout", type=float, default=parallel.DEFAULT_TIMEOUT_S)
    a = p.parse_args()
    join(a.tp, a.rank, a.port, a.device, a.tp_timeout)
    follow()


if __name__ == "__main__":
    main()
