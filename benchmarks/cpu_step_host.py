"""The batched engine's HOST cost per step under continuous arrivals (issue 21), on the CPU, with the model's
forward made negligible: a randomly initialised Qwen2-shaped target with no decoder layers (the embedding, the
span's physical slots, the position write, the final norm and a 512-id LM head are all that run), so what is timed
is the scheduler, the runner's packing and sampling, the block manager and the emission: the Python and torch-op
work a GPU step pays on the host whatever its kernels cost.

The load is distill's: max_batch requests running, 2 x max_batch queued, prompts of 64-1024 tokens and budgets of
32-256 tokens, so requests finish and join nearly every step (a step with prompt chunks runs the packed eager pass;
one without, the graph-shaped decode step). Per batch size it prints the mean host ms of a step (Scheduler.step's
CPU time, the best of 3 runs of STEPS steps: the 2 shared cores' other load does not count), split by kind (with
chunks / decode-only), and the torch ops a step runs outside the model's layers (top-level non-view aten ops under
torch.profiler, as cpu_round_opcount counts them), by phase. Those include host-side ops on CPU tensors (index
building before the one copy to the device), which on CUDA are no launch.

    OMP_NUM_THREADS=1 python benchmarks/cpu_step_host.py [--batch 64,256] [--steps 200] [--cprofile] [--overlap]

--overlap: the scheduler's overlapped steps (off by default): the same host work, each step's read a step late;
on the CPU nothing runs meanwhile, so this counts what overlap adds to the host's work, not what it hides.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import pstats
import random
import statistics
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from trtllm_microspec.engine import runner as runner_mod
from trtllm_microspec.engine import spec_runner
from trtllm_microspec.engine import scheduler as sched_mod
from trtllm_microspec.models.model import ModelConfig, Transformer
from trtllm_microspec.speculative import sampling

from cpu_round_opcount import NOOP_UNLESS_COPY as OPCOUNT_NOOP, top_ops  # benchmarks/ is on sys.path

# the op classification of the round counts, and aten::to's copy itself
NOOP_UNLESS_COPY = OPCOUNT_NOOP | {"aten::_to_copy"}
SYNCS = {"aten::item", "aten::_local_scalar_dense"}  # a device -> host read when on a device tensor


def tiny_target(max_seq_len: int = 4096) -> Transformer:
    """Qwen2-shaped (GQA, bias) and tiny; its decoder layers removed after the runner sized its KV pool."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_seq_len=max_seq_len, tie_word_embeddings=True, attention_bias=True, eos_ids=[])
    return Transformer(cfg).setup(torch.float32, torch.device("cpu"))


def make(batch: int, overlap: bool = False, method: str = "ar"):
    """method microspec: the speculative runner with the GPU's tree (60 tokens), a random EAGLE-2 head of the tiny
    target's shape (its layer a no-op, as the target's are removed) and a 256-id window, every
    decoding step plain (as under a load where no tree pays): what its plain and prompt steps cost the host beside
    AR's."""
    t = tiny_target()
    if method == "ar":
        runner = runner_mod.BatchRunner(t, batch, kv_memory=1.0,
                                        max_num_tokens=runner_mod.DEFAULT_MAX_NUM_TOKENS["cuda"])
    else:
        from trtllm_microspec.speculative.eagle import EagleDraft, draft_config
        from trtllm_microspec.speculative.tree import TreeConfig
        from trtllm_microspec.vocab.strategies import make_vocab
        draft = EagleDraft(draft_config(t.cfg), bias=False).setup(t, torch.float32, torch.device("cpu"))
        vocab = make_vocab(method, t.head_weight, [], w_max=256)
        runner = spec_runner.SpecRunner(t, draft, vocab, TreeConfig(5, 10, 60), 3, 3, batch, kv_memory=1.0, k_tree=3)
        runner.policy.choose = lambda reqs, rows: 0  # plain rows every step
        draft.layers = nn.ModuleList([NoLayer()])  # the draft's fc alone: no attention run on the CPU's cores
    t.layers = nn.ModuleList()  # the forward: embedding, physical slots, position write, final norm
    return runner, sched_mod.Scheduler(runner, batch, overlap)


class NoLayer(nn.Module):
    """A decoder layer that adds nothing (the draft's, as the stub target's are removed)."""

    def forward(self, res, delta, delta_norm, attn_args):
        return res, torch.zeros_like(res)


class Load:
    """distill's pattern: the queue refilled to 2 x max_batch before every step."""

    def __init__(self, sched, seed: int = 0):
        self.sched, self.rng = sched, random.Random(seed)

    def refill(self) -> None:
        s, rng = self.sched, self.rng
        while len(s.waiting) + len(s.running) < 3 * s.max_batch:
            s.add([rng.randrange(1, 512) for _ in range(rng.randint(64, 1024))], rng.randint(32, 256))

    def step(self):
        self.refill()
        return self.sched.step()


def warm(load: Load) -> None:
    """Until the batch is full and the first requests have started to finish."""
    s = load.sched
    while len(s.running) < s.max_batch or not any(r.done for r in list(s.running)):
        load.step()
    for _ in range(50):
        load.step()


MODEL = [0.0]  # CPU seconds inside the stub model (forward, LM head, argmax): not the engine's host work


def stub_timed() -> None:
    """Count the stub model's own CPU time apart (on a GPU it is kernel launches of its own)."""
    for obj, name in ((Transformer, "forward"), (Transformer, "logits"), (Transformer, "argmax")):
        fn = getattr(obj, name)

        def run(*a, fn=fn, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                MODEL[0] += time.thread_time() - t0
        setattr(obj, name, functools.wraps(fn)(run))


def timed(load: Load, steps: int) -> dict:
    s = load.sched
    kinds = collections.defaultdict(list)
    joins = 0
    MODEL[0] = 0.0
    for _ in range(steps):
        before = len(s.history)
        load.refill()  # (the load's own prompt making is not the engine's)
        t0 = time.thread_time()  # this thread's CPU time: the 2 shared cores' other work does not count
        s.step()
        dt = time.thread_time() - t0
        rec = s.history[-1] if len(s.history) > before else None
        kinds["chunks" if rec and rec.chunks else "decode"].append(dt)
        joins += bool(rec and rec.chunks)
    every = kinds["chunks"] + kinds["decode"]
    return {"all": statistics.mean(every) * 1e3, "model": MODEL[0] / steps * 1e3,
            **{k: (statistics.mean(v) * 1e3, len(v)) for k, v in kinds.items()}}


_WRAPPED: list = []


def labelled(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)
    _WRAPPED.append((obj, name, fn))

    @functools.wraps(fn)
    def run(*a, **k):
        with record_function(label):
            return fn(*a, **k)
    setattr(obj, name, run)


def label_phases() -> None:
    S, R = sched_mod.Scheduler, runner_mod.BatchRunner
    labelled(S, "_schedule", "schedule")
    labelled(S, "_emit", "emit")
    labelled(R, "join", "join")
    labelled(R, "map_blocks", "map_blocks")
    labelled(R, "pack", "pack")
    labelled(R, "prepare", "prepare")
    labelled(Transformer, "forward", "forward")
    labelled(Transformer, "logits", "logits")
    labelled(sampling.Sampler, "choose", "sample")
    labelled(R, "advance", "advance")


def unlabel() -> None:
    while _WRAPPED:
        obj, name, fn = _WRAPPED.pop()
        setattr(obj, name, fn)


def ops_per_step(load: Load, steps: int) -> tuple[collections.Counter, collections.Counter, int]:
    """(ops by phase, ops by name, steps with chunks) of `steps` steps."""
    s = load.sched
    before = len(s.history)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            load.step()
    mixed = sum(bool(r.chunks) for r in list(s.history)[before:])
    by_phase, by_name = collections.Counter(), collections.Counter()
    for (label, name), c in top_ops(prof, ("aten::",), "(other)", NOOP_UNLESS_COPY).items():
        by_phase[label] += c
        by_name[name] += c
    return by_phase, by_name, mixed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--op-steps", type=int, default=20)
    ap.add_argument("--cprofile", action="store_true", help="print the top functions by own time too")
    ap.add_argument("--overlap", action="store_true", help="the scheduler's overlapped steps")
    ap.add_argument("--method", default="ar", choices=["ar", "microspec"], help="microspec: the speculative "
                    "runner's plain steps (see make)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    stub_timed()
    for B in map(int, a.batch.split(",")):
        runner, sched = make(B, a.overlap, a.method)
        load = Load(sched)
        with torch.no_grad():
            warm(load)
            runs = [timed(load, a.steps) for _ in range(3)]
        r = min(runs, key=lambda x: x["all"])
        parts = ", ".join(f"{k} {v[0]:.2f} ms x {v[1]}" for k, v in r.items() if k not in ("all", "model"))
        print(f"\n## batch {B}: host {r['all']:.2f} ms a step, {r['all'] - r['model']:.2f} ms without the stub "
              f"model's own {r['model']:.2f} ({parts}; CPU time, the best of 3 runs of {a.steps} steps)")
        label_phases()  # only while the ops are counted: the wrappers cost host time themselves
        by_phase, by_name, mixed = ops_per_step(load, a.op_steps)
        unlabel()
        n = a.op_steps
        total = sum(v for k, v in by_phase.items() if k != "forward")
        syncs = sum(by_name[k] for k in SYNCS)
        print(f"ops a step outside the layers: {total / n:.1f} ({mixed} of {n} steps with chunks; item() "
              f"{syncs / n:.1f}, a sync on a device tensor; in forward's embedding/slots/norm: "
              f"{by_phase['forward'] / n:.1f})")
        print("  by phase: " + ", ".join(f"{k} {v / n:.1f}" for k, v in by_phase.most_common()))
        print("  by op:    " + ", ".join(f"{k[6:]} {v / n:.1f}" for k, v in by_name.most_common(14)))
        if a.cprofile:
            pr = cProfile.Profile()
            with torch.no_grad():
                for _ in range(a.steps):
                    load.refill()
                    pr.enable()
                    sched.step()
                    pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
