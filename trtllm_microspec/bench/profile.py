"""`microspec profile`: where a decode step's time goes on the GPU, for a real engine (a random EAGLE head).

Phases, each the median of --iters CUDA-graph replays timed with CUDA events, and the number of GPU kernels it
launches (counted with torch.profiler on one eager run): one AR step (1 token + LM head + argmax), one tree
verify (--tree nodes + LM head), one EAGLE-2 draft phase (depth + 1 draft forwards and full-vocabulary heads),
a prefill of --prefill tokens, and the batched engine's AR step for each --batch size (one token per request, paged
KV). Each on the default path ("fast": the Triton layer kernels, and for each projection the skinny GEMM or
cuBLAS, whichever layers.linear measured faster) and on the torch reference (the plain path) in the same run.
Then one decoder layer at T = 1, piece by piece: time, the bytes it must move (weights, the KV it reads), the
bandwidth against this GPU's measured copy bandwidth, and the kernels it launches. Then each projection (q|k|v, O, gate|up,
down with the gated activation, LM head) at each of --rows rows: cuBLAS (F.linear, after act_mul for the down
projection), the fastest skinny-GEMM config, and the default path, each with its GB/s and % of the GPU's HBM peak.
--context committed tokens precede each step.

--timeline instead: the batched engine's step timeline under load (a speculative method with a random EAGLE-3 head
of 32k draft ids, the kind train-draft makes, unless --draft). For each --batch size B, B requests of --context
random prompt tokens and --new-tokens new tokens each (an end of answer does not stop them), submitted at once
(greedy, CUDA graphs, the engine's defaults: --max-num-tokens, --kv-memory), once to warm up (graph captures) and
once measured; from the scheduler's own record of every step: the GPU time of its pass (CUDA events), the host time
of the step around it, the rows it ran, for the steps with prompt chunks and the decode-only steps apart.
Without overlap (--no-overlap, and a speculative method's rounds and prompt steps) the GPU idles for the host part
of every step (host = step - GPU); with it (the default: AR's steps, a speculative method's plain decode-only ones), a
step's call launches it and then waits for the step before, so step - GPU is the GPU's idle time per step and GPU
share its busy fraction.
"""
from __future__ import annotations

import argparse
import bisect
from contextlib import nullcontext

import torch

from plugins import layers
from plugins.layers import KV_BLOCK
from plugins.check_layers import random_tree

from ..engine.policy import POLICIES
from ..models.model import KVCache, Span
from ..models.registry import UserError
from ..vocab.strategies import METHODS
from ..speculative.batch_tree import draft_trees, verify
from ..speculative.tree import Tree, TreeConfig, causal
from .kernels import (Timer, copy_bw, peak_bw, count_kernels, projection_ab, projection_lines, weight_bytes,
                      write_report)


RANDOM_DRAFT_VOCAB = 32768  # the random head's draft vocabulary: train-draft's default --loss-vocab
TOP_KERNELS = 10  # --trace: the kernels listed per round piece


def run(a) -> None:
    from ..engine.loader import load_target
    from ..llm import resolve_engine
    from ..speculative.eagle import EagleDraft, draft_config
    from ..vocab.batched import SharedVocab
    from ..vocab.strategies import FullVocab

    if a.timeline:  # the CPU runs it too (no GPU times): a check of the tool
        timeline(a)
        return
    if not torch.cuda.is_available():
        raise UserError("profile needs a CUDA GPU")
    dev = torch.device("cuda")
    target, _ = load_target(resolve_engine(a.engine), dev, torch.bfloat16, None)
    c = target.cfg
    torch.manual_seed(0)
    draft = EagleDraft(draft_config(c), bias=False).setup(target, torch.bfloat16, dev)
    vocab = SharedVocab(FullVocab(target.head_weight))
    g = torch.Generator().manual_seed(0)
    L, n, zero = a.prefill, torch.tensor(a.context, device=dev), torch.tensor(0, device=dev)
    ids = torch.randint(c.vocab_size, (max(L, a.context),), generator=g).to(dev)
    S = a.context + 256
    anc = random_tree(g, a.tree, reach=8).to(dev)
    depth = anc.sum(1) - 1
    tree_tokens = torch.randint(c.vocab_size, (a.tree,), generator=g).to(dev)
    root = ids[:1].clone()
    h_last = torch.randn(c.hidden_size, generator=g).to(dev, torch.bfloat16)
    cfg = TreeConfig()
    one = causal(1, dev)
    with torch.no_grad():  # fill the caches so the steps attend over real keys
        pos = torch.arange(a.context, device=dev)
        target(ids[:a.context], pos, pos, Span(zero, causal(a.context, dev), a.context))

    # one request of the batched round's functions (B = 1) on the target's own cache (no block table)
    tree = Tree(tokens=tree_tokens[None], parent=torch.zeros_like(depth)[None], depth=depth[None], anc=anc[None])
    n1, batch = n.view(1), torch.zeros(1, dtype=torch.long, device=dev)
    dcache = KVCache(draft.cfg, draft.cfg.num_layers, torch.bfloat16, dev)
    phases = {
        "AR step (1 token + head + argmax)": lambda: target.logits(target(root, n.view(1), n.view(1),
                                                                         Span(n, one, S))).argmax(-1),
        f"tree verify ({a.tree} tokens + head)": lambda: verify(target, target.cache, tree, n1, None, S),
        f"draft phase (depth {cfg.depth}, top-{cfg.top_k}, full head)": lambda: draft_trees(
            draft, dcache, lambda h, k: vocab.head(h, batch, 1, k), h_last[None], root, n1, None, S, cfg),
        f"prefill ({L} tokens)": lambda: target(ids[:L], torch.arange(L, device=dev), torch.arange(L, device=dev),
                                                Span(zero, causal(L, dev), L)),
    }
    blocks = S // KV_BLOCK  # the batched engine's AR step: B requests of --context tokens, in one paged pool
    pool = KVCache(c, c.num_layers, torch.bfloat16, dev, slots=max(a.batch) * blocks * KV_BLOCK)
    for B in a.batch:
        nb, table = torch.full((B,), a.context, device=dev), torch.arange(B * blocks, device=dev).view(B, blocks)
        span = Span(nb, one.expand(B, 1, 1), S, table)
        phases[f"AR step, batch of {B} (paged KV)"] = (
            lambda nb=nb, span=span: target.logits(target(ids[:nb.numel()], nb, nb, span, cache=pool)).argmax(-1))
    timer = Timer(a.iters)
    rows = []
    for name, fn in phases.items():
        for path, use in (("fast", True), ("reference", False)):
            with nullcontext() if use else layers.path(False), torch.no_grad():
                ms = timer(fn) / 1e3
                k = count_kernels(fn)
            rows.append(dict(phase=name, path=path, ms=ms, kernels=k))
            print(f"profile: {name:48s} {path:9s} {ms:8.3f} ms {k:6d} kernels", flush=True)
    layer_rows = layer_table(target, n, S, timer)
    proj_rows = projection_table(target, a.rows, timer)
    meta = dict(engine=str(a.engine), device=torch.cuda.get_device_name(), torch=torch.__version__,
                context=a.context, iters=a.iters, weights_gb=read_bytes(target) / 1e9)
    write_report(a.out, markdown(rows, layer_rows, proj_rows, meta),
                 dict(meta=meta, phases=rows, layer=layer_rows, projections=proj_rows))


def timeline(a) -> None:
    import tempfile
    import time

    from ..engine.stats import percentiles
    from ..llm import LLM, resolve_engine
    from ..models.model import ModelConfig
    from ..speculative.eagle3 import random_head

    if a.requests < 0:
        raise UserError(f"--requests must be 0 or more, got {a.requests}")
    top = max(a.batch)
    with tempfile.TemporaryDirectory() as tmp:
        draft = a.draft
        if a.method != "ar" and draft is None:  # a random head: a round's work does not depend on what it accepts.
            # EAGLE-3 with the recipe's 32k draft vocabulary, the kind train-draft makes, whose rounds cost more than
            # an EAGLE-2 head's (fc over three target layers, q|k|v over 2d): on the H200 a round of `bench` with the
            # recipe's head took ~3.9 ms of wall time, this profile's with a random EAGLE-2 head 3.40 ms of GPU time
            engine = resolve_engine(a.engine)
            random_head(engine, tmp, min(RANDOM_DRAFT_VOCAB, ModelConfig.load(engine / "config.json").vocab_size))
            draft = tmp
        llm = LLM(a.engine, a.method, draft=draft, max_batch=top, kv_memory=a.kv_memory,
                  max_num_tokens=a.max_num_tokens, spec_policy=a.spec_policy, overlap=a.overlap)
        sched = llm.scheduler()  # (a speculative one calibrates its policy now: every graph it may pick captured)
    # every request runs its --new-tokens: on random prompts the model may end its answer at once (on the H200,
    # qwen2.5-coder-1.5b's 128-token requests stopped after 4-6 steps, and the --trace pass's eager one before any
    # round), and a profile measures steps, not answers
    sched.stop_ids = set()
    target, runner, cuda = llm.target, sched.runner, llm.device.type == "cuda"
    sched.timing = True
    g = torch.Generator().manual_seed(0)
    rows, steps = [], {}
    for B in a.batch:
        sched.max_batch = B
        for measured in (False, True):  # the first pass captures the CUDA graphs its buckets need
            reqs = submit(sched, B, a, g)
            sched.history.clear()
            sync = torch.cuda.synchronize if cuda else lambda: None
            sync()
            t0 = time.perf_counter()
            sched.run(reqs)
            sync()
            wall = time.perf_counter() - t0
        recs = [r for r in sched.history if r.tokens]
        per_step = [dict(decodes=r.decodes, prompt_tokens=sum(r.chunks), chunks=len(r.chunks), rows=r.tokens,
                         preempted=r.preempted, gpu_ms=r.gpu_ms, step_ms=r.step_s * 1e3, plan_ms=r.plan_s * 1e3,
                         launch_ms=None if r.launch_s is None else r.launch_s * 1e3)
                    for r in recs]
        steps[B] = per_step
        tokens = sum(len(r.out) for r in reqs)
        for kind, sel in (("with prompt chunks", [s for s in per_step if s["chunks"]]),
                          ("decode only", [s for s in per_step if not s["chunks"]])):
            if not sel:
                continue
            med = lambda k: percentiles([s[k] for s in sel if s[k] is not None], (50,))["p50"]  # noqa: E731
            host = gpu = share = None
            if cuda:
                gpu = med("gpu_ms")
                host = percentiles([s["step_ms"] - s["gpu_ms"] for s in sel], (50,))["p50"]
                share = sum(s["gpu_ms"] for s in sel) / sum(s["step_ms"] for s in sel)
            rows.append(dict(batch=B, kind=kind, steps=len(sel), rows_p50=med("rows"), gpu_ms_p50=gpu,
                             step_ms_p50=med("step_ms"), host_ms_p50=host, plan_ms_p50=med("plan_ms"),
                             launch_ms_p50=med("launch_ms"),
                             gpu_share=share, tok_s=tokens / wall, wall_s=wall,
                             preempted=sum(s["preempted"] for s in per_step)))
            r = rows[-1]
            print(f"timeline: batch {B:4d} {kind:18s} {r['steps']:5d} steps, rows p50 {r['rows_p50']:6.0f}, GPU "
                  f"{_f(gpu, '7.2f')} ms, step {r['step_ms_p50']:7.2f} ms (host {_f(host, '6.2f')}, launch "
                  f"{_f(r['launch_ms_p50'], '6.2f')}), "
                  f"{r['tok_s']:8.0f} output tok/s overall", flush=True)
    meta = dict(engine=str(a.engine), device=torch.cuda.get_device_name() if cuda else "cpu",
                torch=torch.__version__, context=a.context, new_tokens=a.new_tokens, method=a.method,
                tree=str(llm.tree) if a.method != "ar" else None, spec_policy=a.spec_policy,
                max_num_tokens=runner.max_num_tokens, kv_blocks=runner.blocks.num_blocks, overlap=sched.overlap)
    shape = "" if a.method == "ar" else (f" ({llm.tree}, --spec-policy {a.spec_policy}; a random EAGLE-3 head of "
                                          f"{RANDOM_DRAFT_VOCAB} draft ids unless --draft)")
    lines = [f"# batched engine step timeline: {meta['engine']} on {meta['device']}, {a.method}{shape}", "",
             f"torch {meta['torch']}; per batch size B: {arrivals(a)}, greedy, CUDA graphs (on CUDA); max_num_tokens "
             f"{meta['max_num_tokens']}, {meta['kv_blocks']} KV blocks. Medians over the measured pass's steps. "
             f"GPU: the pass (CUDA events); step: the host's whole step (schedule, inputs, launch, wait, emit); "
             f"host = step - GPU, when the GPU idles. Launch: the host's time to launch the pass alone (overlap "
             f"only): a launch as long as the GPU's time is a step bound by its launches (the GPU's time then holds "
             f"its waits for them). GPU share: GPU time / step time over those steps. Overlap "
             f"{'on' if meta['overlap'] else 'off'} (an AR step scheduled and launched while the one before runs).", "",
             "| batch | steps | count | rows p50 | GPU ms p50 | step ms p50 | host ms p50 | plan ms p50 | launch ms p50 "
             "| GPU share | output tok/s (whole pass) | preempted |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['kind']} | {r['steps']} | {r['rows_p50']:.0f} | {_f(r['gpu_ms_p50'], '.2f')} | "
              f"{r['step_ms_p50']:.2f} | {_f(r['host_ms_p50'], '.2f')} | {r['plan_ms_p50']:.2f} | "
              f"{_f(r['launch_ms_p50'], '.2f')} | "
              f"{_f(r['gpu_share'], '.0%')} | {r['tok_s']:.0f} | {r['preempted']} |" for r in rows]
    costs = []  # the speculation policy's calibration: one step of each shape over padding rows, graph replayed
    policy = getattr(runner, "policy", None)
    if policy is not None:
        for (shape, Bb), sec in sorted(policy.costs.base.items()):
            tree = runner.shapes[shape]
            # and what the policy holds after the passes: corrected by the shape's own steps at that bucket
            # (a tree not run there: as the plain shape's, StepCosts), or the calibration where nothing corrected it
            costs.append(dict(shape=f"{tree.total_tokens} tokens (depth {tree.depth}, top-{tree.top_k})" if tree
                              else "plain rows (root only)", rows=Bb, ms=sec * 1e3,
                              now_ms=policy.costs(shape, Bb) * 1e3, own_steps=(shape, Bb) in policy.costs.drift))
            c = costs[-1]
            print(f"timeline: calibrated step, {c['shape']:32s} rows {Bb:4d}: {c['ms']:7.3f} ms, after the passes "
                  f"{c['now_ms']:7.3f} ms{' (its own steps)' if c['own_steps'] else ''}", flush=True)
    if costs:
        lines += ["", "The speculation policy's calibrated step costs (SpecRunner.measure at start-up: padding rows, "
                  "the captured graph replayed, the host read included; min of 3), and its estimates after the "
                  "passes: corrected by the shape's own steps at that rows bucket (an overlapped plain step timed "
                  "at its read), a tree with none there as the plain shape's:", "",
                  "| shape | rows | calibrated ms | after the passes ms | from its own steps |", "|---|---:|---:|---:|---|"] + \
            [f"| {c['shape']} | {c['rows']} | {c['ms']:.3f} | {c['now_ms']:.3f} | {'yes' if c['own_steps'] else 'no'} |"
             for c in costs]
    if a.trace:
        lines += ["", *trace(sched, target, a, g)]
    write_report(a.out, "\n".join(lines) + "\n", dict(meta=meta, timeline=rows, steps=steps, costs=costs))


def submit(sched, B: int, a, g) -> list:
    """A pass's requests (arrivals says which)."""
    vocab = sched.runner.target.cfg.vocab_size

    def length(n: int) -> int:  # --requests: uniform in [n / 4, n]
        return n if not a.requests else int(torch.randint(max(1, n // 4), n + 1, (1,), generator=g))

    out = []
    for _ in range(a.requests or B):
        prompt = torch.randint(100, vocab, (length(a.context),), generator=g).tolist()
        out.append(sched.add(prompt, length(a.new_tokens)))
    return out


def arrivals(a) -> str:
    if not a.requests:
        return f"B requests of {a.context} random prompt tokens and {a.new_tokens} new tokens each, submitted at once"
    return (f"{a.requests} requests of {max(1, a.context // 4)}-{a.context} random prompt tokens and "
            f"{max(1, a.new_tokens // 4)}-{a.new_tokens} new tokens (uniform), at most B running: as requests finish "
            f"the next prompts join the running batch in small chunks, as under the load bench")


def trace(sched, target, a, g) -> list[str]:
    """--trace: the largest batch's pass once more under torch.profiler, each step a labelled range (steps with
    prompt chunks apart from decode-only ones): the host and GPU time of each kind and the ops and kernels that
    take it. Profiling slows the host, so the times are for reading shares, not throughput."""
    from torch.profiler import ProfilerActivity, profile, record_function

    runner, B = sched.runner, max(a.batch)

    def labelled(fn):
        def step(chunks, decodes):
            with record_function("step with prompt chunks" if chunks else "decode-only step"):
                return fn(chunks, decodes)
        return step

    for name in ("step", "step_async"):  # the synchronous step, or the overlapped one's launch (AR's default)
        setattr(runner, name, labelled(getattr(runner, name)))
    sched.max_batch = B
    reqs = submit(sched, B, a, g)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.cache.k.is_cuda else [])
    try:
        with profile(activities=acts) as prof:
            sched.run(reqs)
            if target.cache.k.is_cuda:
                torch.cuda.synchronize()
    finally:
        del runner.step, runner.step_async  # the class's own again
    avg = prof.key_averages()
    cuda = target.cache.k.is_cuda
    def dev(e, key="device_time_total"):  # (older torch: cuda_time_total)
        return getattr(e, key, getattr(e, key.replace("device", "cuda"), 0)) if cuda else 0

    out = [f"## --trace: batch {B} under torch.profiler", "",
           "| range | count | host ms (total) | GPU ms (total, kernels in the range) |", "|---|---:|---:|---:|"]
    n_steps = 0
    for e in avg:
        if e.key in ("step with prompt chunks", "decode-only step"):
            n_steps += e.count
            out.append(f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:.1f} | {dev(e) / 1e3:.1f} |")
    n_steps = max(n_steps, 1)
    if cuda:  # CUPTI records the kernels inside a CUDA-graph replay one by one, so this counts a graphed step too
        launched = sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memset"))
        out += ["", f"GPU kernels per step: {launched / n_steps:.0f} ({launched} over {n_steps} steps)"]
    ops = sorted((e for e in avg if e.key.startswith("aten::") or e.key.startswith("triton")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    out += ["", "host ops by self time:", "", "| op | count | self host ms |", "|---|---:|---:|"]
    out += [f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} |" for e in ops]
    if cuda:
        kernels = sorted((e for e in avg if dev(e, "self_device_time_total") > 0 and "CUDA" in str(e.device_type)),
                         key=lambda e: dev(e, "self_device_time_total"), reverse=True)[:20]
        out += ["", "GPU kernels by time:", "", "| kernel | count | GPU ms | per step: count | per step: us |",
                "|---|---:|---:|---:|---:|"]
        out += [f"| {cell(e.key[:90])} | {e.count} | {dev(e, 'self_device_time_total') / 1e3:.1f} | "
                f"{e.count / n_steps:.1f} | {dev(e, 'self_device_time_total') / n_steps:.1f} |" for e in kernels]
    if hasattr(runner, "draft"):
        out += ["", *round_phases(sched, target, a, g)]
    for line in out:
        print(f"trace: {line}", flush=True)
    return out


# a round's pieces, by the names spec_runner.py calls them: (label, module, attribute)
PHASES = [("draft tree (depth steps: draft layer + head + growth, the selection)", "runner", "draft_trees"),
          ("verify (target pass over the tree + LM head)", "runner", "verify"),
          ("accept", "runner", "accept"),
          ("draft layer (every call: the tree's steps, catch-up, the accepted path)", "draft", "hidden"),
          ("window update (ids in, gathers queued)", "vocab", "update")]


ROUND = ("round", "engine", "_round")  # a whole round (SpecRunner._round), plain steps apart
PROMPT_STEP = ("step with prompt chunks", "engine", "packed")  # its target pass and draft pass (SpecRunner.packed)
# a step with prompt chunks' pieces, beside the draft layer (PHASES); the target's calls inside a round run in verify
PROMPT_PHASES = [("target pass (the step's rows)", "target", "forward"),
                 ("LM head (each prompt row's for its top-K_pre, the sampled rows')", "target", "logits"),
                 ("top-K over the vocabulary", "target", "topk"),
                 ("window start (each prompt that ends in the step)", "vocab", "start")]


def read_bytes(target) -> int:
    """The weight bytes a target pass reads at least: every weight but an untied embedding table, of which a step
    gathers only its tokens' rows (qwen2.5-coder-1.5b in bf16: 3.09 GB of its 3.55)."""
    return weight_bytes(target) - (0 if target.cfg.tie_word_embeddings else weight_bytes(target.embed_tokens))


def kernels_in(kernels: list[tuple[float, float, str]], intervals: list[tuple[float, float]]) -> dict[str, list]:
    """The kernels (start, duration, name) that start inside one of the intervals (start, end; disjoint: one
    label's ranges, which never nest, or a merged union), all on the profiler's one clock -> per kernel name
    [GPU time, count]."""
    spans = sorted(intervals)
    starts = [s for s, _ in spans]
    by_name: dict[str, list] = {}
    for start, dur, name in kernels:
        i = bisect.bisect_right(starts, start) - 1  # the last interval starting at or before the kernel
        if i >= 0 and start <= spans[i][1]:
            t = by_name.setdefault(name, [0.0, 0])
            t[0] += dur
            t[1] += 1
    return by_name


def total_of(by_name: dict[str, list]) -> tuple[float, int]:
    """kernels_in's GPU time and count over every name."""
    return sum(t for t, _ in by_name.values()), sum(k for _, k in by_name.values())


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals (nested or overlapping: the draft layer's calls inside the draft tree) as disjoint
    ones."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def round_phases(sched, target, a, g) -> list[str]:
    """--trace, speculative: one more pass of the largest batch run eagerly (no graphs: kernels inside a replay
    carry no range) with each of a round's pieces in a labelled range -> the GPU time of the kernels in each, per
    round. A kernel runs as long eagerly as replayed; the gaps between them are not counted. On CUDA each range
    starts and ends with a device synchronize, so the kernels it launched run inside its time span, and a kernel
    is the range's when it starts in it (kernels_in): the profiler's launch links miss Triton's launches (on the
    H200 they left a verify with cuBLAS's kernels alone, under its byte floor)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..engine import spec_runner as runner_mod

    runner, B = sched.runner, max(a.batch)
    owners = dict(runner=runner_mod, draft=runner.draft, vocab=runner.vocab, engine=runner, target=target)
    saved = []
    cuda = target.cache.k.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def wrap(label, fn):
        def inner(*args, **kw):
            sync()
            with record_function(label):
                out = fn(*args, **kw)
                sync()
            return out
        return inner

    for label, owner, name in PHASES + PROMPT_PHASES + [ROUND, PROMPT_STEP]:
        obj = owners[owner]
        saved.append((obj, name, obj.__dict__.get(name)))  # None: a method of the class, not the instance's own
        setattr(obj, name, wrap(label, getattr(obj, name)))
    graphs, runner.graphs = runner.graphs, None
    reqs = [sched.add(torch.randint(100, target.cfg.vocab_size, (a.context,), generator=g).tolist(), a.new_tokens)
            for _ in range(B)]
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            sched.run(reqs)
            if cuda:
                torch.cuda.synchronize()
    finally:
        runner.graphs = graphs
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
    failed = [r.error for r in reqs if getattr(r, "error", None)]
    if failed:  # the scheduler fails a request whose step raised and goes on: say so, not "0 rounds"
        return [f"## --trace: one round's pieces: the eager pass failed ({failed[0]})"]
    # the host's ranges (the GPU's own annotation of a range, where the profiler makes one, has the name too)
    host = [e for e in prof.events() if "CPU" in str(e.device_type)]
    rounds = [e for e in host if e.name == ROUND[0]]
    spans = {label: [e for e in host if e.name == label] for label, _, _ in PHASES}
    n = max(len(rounds), 1)

    kernels = [(e.time_range.start, e.time_range.elapsed_us(), e.name) for e in prof.events()
               if "CUDA" in str(e.device_type) and not getattr(e, "is_user_annotation", False)]

    def intervals(ranges) -> list[tuple[float, float]]:
        return [(e.time_range.start, e.time_range.end) for e in ranges]

    def gpu_us(ranges) -> tuple[float, int]:  # the kernels that ran inside the ranges: their GPU time and count
        return total_of(kernels_in(kernels, intervals(ranges)))

    # the weight bytes a piece must read at least: the verify the target's (read_bytes), a draft layer call its
    # decoder layer's (EAGLE-3's fc too on feature calls: not counted)
    bw = copy_bw()
    floor_us = {"verify": read_bytes(target) / bw * 1e6, "draft layer": weight_bytes(runner.draft.layers) / bw * 1e6}
    out = [f"## --trace: one round's pieces, batch {B}, eager (kernel GPU time inside each range, per round; "
           f"{len(rounds)} rounds); the profiler's own device total of the ranges beside; byte floor: the bf16 weights "
           f"the piece reads at {bw / 1e12:.2f} TB/s (this GPU's copy rate, measured), per round", "",
           "| piece | calls / round | GPU us / round | kernels / round | device total us / round | byte floor us | "
           "x floor |", "|---|---:|---:|---:|---:|---:|---:|"]

    def total(ranges) -> float:
        return sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in ranges)

    def floor(us, f) -> str:
        return f"{f:.0f} | {us / f:.1f}" if f else "- | -"

    calls = {label.split(" (")[0]: len(spans[label]) / n for label, _, _ in PHASES}
    round_floor = floor_us["verify"] * calls["verify"] + floor_us["draft layer"] * calls["draft layer"]
    whole, k_all = gpu_us(rounds)
    out.append(f"| whole round (plain steps apart) | 1 | {whole / n:.0f} | {k_all / n:.0f} | {total(rounds) / n:.0f} | "
               f"{floor(whole / n, round_floor)} |")
    for label, _, _ in PHASES:
        us, k = gpu_us(spans[label])
        short = label.split(" (")[0]
        out.append(f"| {label} | {calls[short]:.1f} | {us / n:.0f} | {k / n:.0f} | {total(spans[label]) / n:.0f} | "
                   f"{floor(us / n, floor_us.get(short, 0) * calls[short])} |")
    # each piece's largest kernels, and the round's kernels outside every piece (the sampler, the top-K over the
    # trees' logits, the KV moves, the features): where a piece's time goes, by kernel
    pieces = {label.split(" (")[0]: kernels_in(kernels, intervals(spans[label])) for label, _, _ in PHASES}
    inside = kernels_in(kernels, merged([iv for label, _, _ in PHASES for iv in intervals(spans[label])]))
    rest = {name: [t - inside.get(name, [0, 0])[0], k - inside.get(name, [0, 0])[1]]
            for name, (t, k) in kernels_in(kernels, intervals(rounds)).items()}
    pieces["outside the pieces"] = {name: tk for name, tk in rest.items() if tk[1] > 0}
    out += ["", f"Each piece's largest kernels (the {TOP_KERNELS} by GPU time), per round:", "",
            "| piece | kernel | calls / round | GPU us / round |", "|---|---|---:|---:|"]
    for piece in ("draft tree", "draft layer", "verify", "outside the pieces"):
        top = sorted(pieces[piece].items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
        out += [f"| {piece} | {cell(name[:80])} | {k / n:.1f} | {t / n:.1f} |" for name, (t, k) in top]
    return out + prompt_pieces(host, kernels, B)


def prompt_pieces(host, kernels, B: int) -> list[str]:
    """round_phases' steps with prompt chunks (SpecRunner.packed), piece by piece: the ranges of PROMPT_PHASES and
    the draft layer that start inside such a step, per step; and the step's largest kernels."""
    steps = [e for e in host if e.name == PROMPT_STEP[0]]
    if not steps:
        return []
    n = len(steps)
    outer = sorted((e.time_range.start, e.time_range.end) for e in steps)

    def inside(label) -> list[tuple[float, float]]:
        return [(e.time_range.start, e.time_range.end) for e in host if e.name == label
                and any(s <= e.time_range.start <= t for s, t in outer)]

    out = ["", f"## --trace: a step with prompt chunks piece by piece, batch {B}, eager (kernel GPU time inside each "
           f"range, per step; {n} steps)", "", "| piece | calls / step | GPU us / step | kernels / step |",
           "|---|---:|---:|---:|"]
    us, k = total_of(kernels_in(kernels, outer))
    out.append(f"| whole step | 1 | {us / n:.0f} | {k / n:.0f} |")
    for label in [lab for lab, _, _ in PROMPT_PHASES] + [lab for lab, _, name in PHASES if name == "hidden"]:
        ranges = inside(label)
        us, k = total_of(kernels_in(kernels, ranges))
        out.append(f"| {label} | {len(ranges) / n:.1f} | {us / n:.0f} | {k / n:.0f} |")
    top = sorted(kernels_in(kernels, outer).items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    out += ["", "| the step's largest kernels | calls / step | GPU us / step |", "|---|---:|---:|"]
    out += [f"| {cell(name[:80])} | {c / n:.1f} | {t / n:.1f} |" for name, (t, c) in top]
    return out


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def layer_table(target, n, S, timer) -> list[dict]:
    """Layer 0 at T = 1, one piece at a time, on the default path."""
    c, layer = target.cfg, target.layers[0]
    at, mlp = layer.self_attn, layer.mlp
    dev = n.device
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, c.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    qkv = layers.linear(x, at.qkv_proj.weight, at.qkv_proj.bias)
    q = torch.randn(1, c.num_heads, c.head_dim, generator=g, device=dev).to(torch.bfloat16)
    o = q.reshape(1, -1)
    gu = layers.linear(x, mlp.gate_up_proj.weight)
    act = "gelu" if mlp.gelu else "silu"
    pos = n.view(1)
    span = Span(n, causal(1, dev), S)
    k, v = target.cache.k[0], target.cache.v[0]
    norm = layer.post_attention_layernorm
    kv_bytes = 2 * c.num_kv_heads * (int(n) + 1) * c.head_dim * 2

    pieces = [
        ("add + RMSNorm", lambda: layers.add_rms_norm(x, x, norm.weight, norm.eps, norm.offset), 3 * x.numel() * 2),
        ("QKV GEMM (+bias)", lambda: layers.linear(x, at.qkv_proj.weight, at.qkv_proj.bias), weight_bytes(at.qkv_proj)),
        ("add + RMSNorm + QKV GEMM (norm_linear: the fold where it measured faster)",
         lambda: layers.norm_linear(x, x, layer.input_layernorm.weight, norm.eps, norm.offset, at.qkv_proj.weight,
                                    at.qkv_proj.bias), weight_bytes(at.qkv_proj) + 3 * x.numel() * 2),
        ("add + RMSNorm + QKV GEMM + rotary + KV write (what the model runs: each fold where measured faster)",
         lambda: layers.norm_linear(x, x, layer.input_layernorm.weight, norm.eps, norm.offset, at.qkv_proj.weight,
                                    at.qkv_proj.bias, rope=at.rope_args(target.rope_global, pos, pos, span,
                                                                        target.cache.pos, 0, k, v)),
         weight_bytes(at.qkv_proj) + 3 * x.numel() * 2),
        ("rotary + KV write", lambda: layers.rope_cache_write(qkv, at.h, at.kv, target.rope_global, pos, pos, k, v,
                                                             None, at.eps), qkv.numel() * 4),
        ("attention", lambda: layers.attention(q, k, v, span, pos, target.cache.pos, 0, at.scale), kv_bytes),
        ("O GEMM", lambda: layers.linear(o, at.o_proj.weight), weight_bytes(at.o_proj)),
        ("gate|up GEMM", lambda: layers.linear(x, mlp.gate_up_proj.weight), weight_bytes(mlp.gate_up_proj)),
        (f"{act} x up (alone; folded into down when its skinny GEMM is picked)",
         lambda: layers.act_mul(gu, act == "gelu"), gu.numel() * 2 * 3 // 2),
        (f"down GEMM, {act} x up included", lambda: layers.linear(gu, mlp.down_proj.weight, act=act),
         weight_bytes(mlp.down_proj)),
        ("whole layer", lambda: layer(x, x, None, (target.rope_global, pos, pos, span, target.cache.pos, 0, k, v)),
         weight_bytes(layer) + kv_bytes),
    ]
    out = []
    with torch.no_grad():
        for name, fn, nbytes in pieces:
            us = timer(fn)
            out.append(dict(piece=name, us=us, mb=nbytes / 1e6, gb_s=nbytes / us / 1e3, kernels=count_kernels(fn),
                            pct_copy=100 * nbytes / us / 1e6 / (copy_bw() / 1e12)))
    return out


def projection_table(target, rows: list[int], timer) -> list[dict]:
    """Layer 0's projections and the LM head at each row count: cuBLAS, the fastest skinny config, the default."""
    layer = target.layers[0]
    at, mlp = layer.self_attn, layer.mlp
    act = "gelu" if mlp.gelu else "silu"
    projections = [("q|k|v (+bias)", at.qkv_proj.weight, at.qkv_proj.bias, None), ("O", at.o_proj.weight, None, None),
                   ("gate|up", mlp.gate_up_proj.weight, None, None),
                   (f"down ({act} x up)", mlp.down_proj.weight, None, act), ("LM head", target.head_weight, None, None)]
    return projection_ab(projections, rows, timer, tag="profile: ")


def cell(name: str) -> str:
    return name.replace("|", "\\|")  # q|k|v, gate|up inside a markdown table cell


def markdown(rows, layer_rows, proj_rows, meta) -> str:
    floor_ms = meta["weights_gb"] * 1e9 / copy_bw() * 1e3
    lines = [f"# profile of {meta['engine']} on {meta['device']}", "",
             f"torch {meta['torch']}; {meta['context']} committed tokens; medians of {meta['iters']} CUDA-graph "
             f"replays (L2 flushed before each); kernels counted on one eager run. Weights {meta['weights_gb']:.2f} GB:"
             f" byte floor of a step {floor_ms:.3f} ms at {copy_bw() / 1e12:.2f} TB/s (this GPU's copy rate).", "",
             "| phase | path | ms | kernels | x floor |", "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['path']} | {r['ms']:.3f} | {r['kernels']} | {r['ms'] / floor_ms:.2f} |")
    lines += ["", "One decoder layer (layer 0) at T = 1 on the default path:", "",
              "| piece | us | MB moved | GB/s | % copy BW | kernels |", "|---|---:|---:|---:|---:|---:|"]
    for r in layer_rows:
        lines.append(f"| {cell(r['piece'])} | {r['us']:.1f} | {r['mb']:.2f} | {r['gb_s']:.0f} | {r['pct_copy']:.0f} | "
                     f"{r.get('kernels', '-')} |")
    lines += ["", "Projections (layer 0) and the LM head: cuBLAS vs the fastest skinny-GEMM config vs the default "
              "path (what the model runs: the skinny GEMM where it measured >= 3% faster at first use, else cuBLAS); "
              f"% of the {peak_bw() / 1e12:.2f} TB/s HBM peak:", ""] + projection_lines(proj_rows)
    return "\n".join(lines) + "\n"


def register(sub) -> None:
    from ..cli import OVERLAP_HELP

    p = sub.add_parser("profile", help="per-phase GPU time and kernel counts of a decode step, and one layer's pieces",
                       description=__doc__)
    p.add_argument("--engine", default="qwen2.5-coder-1.5b", help="engine directory or model key")
    p.add_argument("--context", type=int, default=512, help="committed tokens before the step")
    p.add_argument("--tree", type=int, default=60, help="tree-verify tokens")
    p.add_argument("--prefill", type=int, default=1000, help="prefill tokens")
    p.add_argument("--batch", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16],
                   help="comma list: batch sizes of the batched engine's AR step (paged KV)")
    p.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 60],
                   help="comma list: rows of the per-projection table (cuBLAS vs skinny GEMM vs the path "
                   "layers.linear picks)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--timeline", action="store_true", help="instead of the phases: the batched engine's step "
                   "timeline, --batch requests at once of --context prompt tokens and --new-tokens new tokens each")
    p.add_argument("--new-tokens", type=int, default=128, help="--timeline: new tokens per request")
    p.add_argument("--requests", type=int, default=0, help="--timeline: this many requests of random lengths (up "
                   "to --context prompt and --new-tokens new tokens), at most --batch running, the next joining as "
                   "one finishes: the load bench's steps with small prompt chunks beside the decodes (0: --batch "
                   "requests at once)")
    p.add_argument("--trace", action="store_true", help="--timeline: the largest batch once more under "
                   "torch.profiler: host and GPU time of the steps with prompt chunks and the decode-only ones, the "
                   "ops and kernels that take it")
    p.add_argument("--max-num-tokens", type=int, help="--timeline: the engine's token budget per step (default 8192)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None, help=OVERLAP_HELP)
    p.add_argument("--kv-memory", type=float, help="--timeline: the KV pool (fraction of free GPU memory; default 0.5)")
    p.add_argument("--method", default="ar", choices=METHODS, help="--timeline: the engine's method (a speculative "
                   "one's decode-only steps are its rounds, or plain rows where the policy picks them)")
    p.add_argument("--draft", help="--timeline: the draft head (default: a random one; a round costs the same)")
    p.add_argument("--spec-policy", default="fixed", choices=POLICIES,
                   help="--timeline: the speculation policy (fixed: the configured tree every step)")
    p.add_argument("--out", help="write the markdown here and JSON beside it")
    p.set_defaults(func=run)
