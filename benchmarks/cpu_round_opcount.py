"""Counts the top-level, non-view ops of ONE speculative round at batch 1 (torch.profiler, on the CPU, fp32), i.e.
roughly the kernels a CUDA round launches, broken down by phase; and of the plain-row step and the AR step of the
batched engine. A phase is the innermost labelled call an op runs in: the script wraps the round's functions
(draft_trees, the draft forward, the head, verify, the sampler, accept, cache.move, the vocabulary's update / size /
contains, ...) in torch.profiler.record_function labels, so the code itself carries none. A custom op of
plugins/ops.py counts as one (on CUDA it is one fused kernel; packed_head a GEMM and one kernel), its torch body not.
The model's own forward counts are the CPU path's (the Triton layers launch fewer on CUDA): compare them apart.

    python benchmarks/cpu_round_opcount.py [ENGINE] [METHODS]     # e.g. smollm2-135m microspec,eagle
It also runs on the single-request executor this engine replaced (commit b1df5f7), with that tree on the path:
    PYTHONPATH=/path/to/b1df5f7-worktree python benchmarks/cpu_round_opcount.py smollm2-135m microspec,eagle
"""
import collections
import contextlib
import functools
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from trtllm_microspec.llm import LLM

VIEWS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::transpose",
         "aten::permute", "aten::t", "aten::slice", "aten::select", "aten::narrow", "aten::chunk", "aten::split",
         "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::as_strided", "aten::detach", "aten::alias",
         "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh", "aten::contiguous",
         "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::unbind", "aten::split_with_sizes",
         "aten::expand_as", "aten::view_as", "aten::unflatten", "aten::flatten", "aten::new_empty",
         "aten::new_empty_strided", "aten::numpy_T", "aten::detach_", "aten::set_"}
NOOP_UNLESS_COPY = {"aten::to", "aten::type_as", "aten::contiguous"}  # a kernel only when they copy
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test."
TREE = dict(depth=5, top_k=10, total_tokens=60)  # the GPU's default tree


def labelled(obj, name: str, label: str | None = None):
    """Wrap obj.name (a function or bound method) so its ops count under `label`."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def run(*a, **k):
        with record_function(label or name):
            return fn(*a, **k)
    setattr(obj, name, run)


def count(fn) -> tuple[int, collections.Counter]:
    """Runs fn once under the profiler -> (total ops, Counter of (label, op))."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = top_ops(prof, ("aten::", "microspec::"), "(unlabelled)")
    return sum(ops.values()), ops


def top_ops(prof, prefixes: tuple[str, ...], unlabelled: str, noop=NOOP_UNLESS_COPY) -> collections.Counter:
    """Counter of (label, op) of the profiled top-level ops named with `prefixes`: none called by another op (an
    aten composite, a custom op's torch body), no views, no `noop` op that copied nothing; label = the innermost
    record_function around it (`unlabelled` where none is)."""
    events = [e for e in prof.events() if e.name.startswith(prefixes)]
    inside = set()
    for e in events:
        stack = list(e.cpu_children)
        while stack:
            c = stack.pop()
            inside.add(id(c))
            stack.extend(c.cpu_children)
    ops = collections.Counter()
    for e in events:
        if id(e) in inside or e.name in VIEWS or e.name in noop and not e.cpu_children:
            continue
        p, label = e.cpu_parent, unlabelled
        while p is not None:
            if not p.name.startswith(prefixes) and not p.name.startswith("ProfilerStep"):
                label = p.name
                break
            p = p.cpu_parent
        ops[label, e.name] += 1
    return ops


def report(title: str, fn, top: int = int(os.environ.get("TOP", 6)), setup=None) -> None:
    """setup (uncounted) runs before the warm-up and again before the counted call."""
    for counted in (False, True):
        if setup:
            setup()
        if not counted:
            fn()  # a warm-up of the same call (first-use allocations, the policy's state)
    total, ops = count(fn)
    by_label = collections.Counter()
    for (label, _), c in ops.items():
        by_label[label] += c
    print(f"\n## {title}: {total} ops")
    for label, c in sorted(by_label.items(), key=lambda x: -x[1]):
        names = collections.Counter({op: n for (lb, op), n in ops.items() if lb == label})
        print(f"{c:6d}  {label:28s} " + ", ".join(f"{op[6:] if op.startswith('aten::') else op} {n}"
                                                for op, n in names.most_common(top)))


def batched(engine: str, method: str):
    import trtllm_microspec.engine.spec_runner as R
    import trtllm_microspec.speculative.batch_tree as BT

    llm = LLM(engine, method, device="cpu", dtype="float32", max_seq_len=1024, spec_policy="fixed", **TREE)
    sched = llm.scheduler()
    rn = sched.runner
    req = sched.add(llm.prompt_ids(PROMPT, True), 10 ** 6)
    while not req.out:  # the prompt's pass(es)
        sched.step()
    sched.step()  # a first round
    if method == "ar":
        report(f"{engine} ar: BatchRunner AR step (batch 1)", lambda: rn.decode([req]))
        return
    d, v = rn.draft, rn.vocab
    for name in ("draft_trees", "verify", "accept", "physical"):
        labelled(R, name)
    labelled(BT, "tree_select", "draft_trees.tree_select")
    labelled(d, "hidden", "draft.hidden")
    labelled(rn.target, "forward", "target forward")
    labelled(rn.target, "logits", "target.logits")
    labelled(rn.target, "topk", "target.topk")
    labelled(rn.sampler, "choose", "sampler.choose")
    labelled(rn.cache, "move", "cache.move")
    for name in ("head", "update", "defer", "size", "contains", "join"):
        labelled(v, name, f"vocab.{name}")
    if hasattr(v, "head_for"):  # the head made once a round: its calls count as vocab.head
        make = v.head_for

        def head_for(*a):
            with record_function("vocab.head_for"):
                head = make(*a)

            def call(*b):
                with record_function("vocab.head"):
                    return head(*b)
            return call
        v.head_for = head_for
    for shape in range(len(rn.shapes)):
        def step(shape=shape):
            rn.planned = shape
            with record_function("round (glue)"):
                rn.decode([req])
        report(f"{engine} {method}: one {'plain-row step' if rn.shapes[shape] is None else 'round'} "
               f"(batch 1, {rn.shapes[shape] or 'root only'})", step)
    if hasattr(rn, "lag_max"):  # the lazy draft: a round after plain steps first catches the draft up (one pass)
        def plain_steps(k=8):
            for _ in range(k):
                rn.planned = 0
                rn.decode([req])

        def tree_round():
            rn.planned = 1
            with record_function("round (glue)"):
                rn.decode([req])
        labelled(rn, "_catch_up", "catch-up")
        report(f"{engine} {method}: one round after 8 plain steps (batch 1, {rn.shapes[1]})", tree_round,
               setup=plain_steps)


def single(engine: str, method: str):
    """The single-request executor (commit b1df5f7)."""
    import trtllm_microspec.engine.executor as E
    import trtllm_microspec.spec.tree as T  # b1df5f7 still has spec/

    llm = LLM(engine, method, device="cpu", dtype="float32", max_seq_len=1024, **TREE)
    ex = llm.executor
    gen = ex.run(llm.prompt_ids(PROMPT, True), 10 ** 6)
    next(gen)  # the prefill
    next(gen)  # a first round
    if method == "ar":
        report(f"{engine} ar: Executor AR step", lambda: next(gen))
        return
    for name in ("draft_tree", "verify", "accept"):
        labelled(E, name)
    labelled(T, "_select", "draft_tree._select")
    labelled(ex.draft, "forward", "draft.hidden")
    labelled(ex.target, "forward", "target forward")
    labelled(ex.target, "logits", "target.logits")
    labelled(ex.target, "topk", "target.topk")
    labelled(ex.sampler, "choose", "sampler.choose")
    labelled(ex.target.cache, "move", "cache.move")
    for name in ("head", "update", "size", "contains", "join"):
        labelled(ex.vocab, name, f"vocab.{name}")

    def step():
        with record_function("round (glue)"):
            next(gen)
    report(f"{engine} {method}: one round of the single-request executor ({ex.tree})", step)


def main():
    engine = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    methods = (sys.argv[2] if len(sys.argv) > 2 else "microspec,eagle").split(",")
    torch.set_num_threads(1)
    import importlib.util
    old = importlib.util.find_spec("trtllm_microspec.engine.executor") is not None
    print(f"# ops per step, {engine}, fp32 CPU, torch {torch.__version__}, "
          f"{'single-request executor' if old else 'batched engine'}")
    for m in methods + ["ar"]:
        with contextlib.redirect_stderr(sys.stdout):
            (single if old else batched)(engine, m)


if __name__ == "__main__":
    main()
