"""`microspec serve --tp N`: the Triton model is rank 0 and N - 1 follower processes run the same steps.

`microspec serve` hosts the group's TCP store and starts the followers (`python -m trtllm_microspec.serving.tp`);
the model joins as rank 0 inside Triton's Python stub. Rank 0 sends the LLM's arguments once, then per request
the executor's arguments (prompt ids, budget, sampling), and after every step whether the request ends early (a
stop word, a cancelled or shut down request): everything else each rank decides alike from the same tokens.
These messages go over a gloo group of their own with no deadline, since a follower waits for requests as long as
the server is idle; the steps' tensors go over the model's NCCL (gloo on the CPU) collectives, with --tp-timeout.
"""
from __future__ import annotations

import argparse
import datetime

import torch.distributed as dist

from .. import parallel
from ..engine.loader import pick_device
from ..models.registry import UserError

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


def lead(llm_factory, kwargs: dict):
    """Rank 0: send the LLM's arguments, build it, and make its executor send each request's inputs."""
    _bcast(kwargs)
    llm = llm_factory(**kwargs)
    run = llm.executor.run

    def run_and_send(*request):  # the executor's arguments: prompt ids, budget, sampling parameters
        _bcast(request)
        steps, end_now = run(*request), None
        while True:
            try:
                toks = steps.send(end_now)
            except StopIteration as stop:
                return stop.value
            try:
                end_now = yield toks
            except GeneratorExit:  # the caller stopped (a cancelled request): the followers end theirs too
                _bcast(True)
                _finish(steps)
                raise
            _bcast(bool(end_now))

    llm.executor.run = run_and_send
    return llm


def stop() -> None:
    """Rank 0: the followers exit (the model unloads)."""
    _bcast(None)


def _finish(steps) -> None:
    try:
        steps.send(True)
    except StopIteration:
        pass


def follow() -> None:
    """Ranks > 0: build the same LLM, then run every request rank 0 runs, step for step, until it says stop."""
    from ..llm import LLM

    llm = LLM(**_bcast())
    while (request := _bcast()) is not None:
        steps, end_now = llm.executor.run(*request), None
        while True:
            try:
                steps.send(end_now)
            except StopIteration:
                break
            except UserError:  # a request refused before its first step (e.g. sampling under TP): rank 0 says why
                break
            end_now = _bcast()


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
