"""The overlapped scheduler on a GPU (issue 21; with `--method microspec`, a speculative method's plain steps overlapped
between its synchronous rounds), or with `--compare packed-graphs` the packed passes replayed from
CUDA graphs (issue 36: engine/runner.py GRAPHED_ROWS; AR's, or with `--method microspec` the speculative runner's
target + draft pass, a random EAGLE-3 head unless --draft names one): the same requests through the batched engine with it
off and on, in fp32 (the tokens must be equal: every request gets its tokens alone either way) and timed (output
tok/s of the whole batch, warm: each configuration runs the batch once to capture its graphs, then once measured).

Requests: N prompts of random lengths (16 .. 1024 random ids) and budgets (32 .. 256 tokens), a quarter of them
sampled with their own seeds, all submitted at once. Prints one line per configuration and whether the outputs match.
Where they do not: each differing request's first differing token, and for a greedy one the gap between the two
tokens' logits there (the target alone over the common prefix). The two runs batch differently (with overlap a
finished request leaves a step later, so later joins and the GEMMs' row counts shift), so a tie within fp32
rounding (a gap of ~1e-4 or less) may flip a token in one run: that is not a scheduling bug. A scheduling bug shows
as a clear gap, or in many requests, typically from their second token on.

    python benchmarks/gpu_overlap_check.py --engine qwen2.5-coder-1.5b [--requests 256] [--dtype float32]
        [--compare overlap|packed-graphs] [--method microspec [--draft HEAD] [--spec-policy fixed]]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from trtllm_microspec import LLM
from trtllm_microspec.llm import resolve_engine
from trtllm_microspec.speculative.eagle3 import random_head
from trtllm_microspec.bench.specbench import step_summary
from trtllm_microspec.engine.runner import GRAPHED_ROWS
from trtllm_microspec.models.model import Span
from trtllm_microspec.speculative.sampling import GREEDY, SamplingParams
from trtllm_microspec.speculative.tree import causal


def workload(n: int, vocab: int, longest: int, most_new: int, seed: int = 0):
    rng = random.Random(seed)
    ids = [[rng.randrange(100, vocab - 1) for _ in range(rng.randint(16, longest))] for _ in range(n)]
    budgets = [rng.randint(most_new // 8, most_new) for _ in range(n)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) if i % 4 == 3 else GREEDY for i in range(n)]
    return ids, budgets, params


def sync(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize()


def run(llm: LLM, ids, budgets, params) -> tuple[list[list[int]], float, int, dict]:
    sched = llm.scheduler()
    sched.history.clear()
    reqs = [sched.add(p, m, s) for p, m, s in zip(ids, budgets, params)]
    sync(llm)
    t0 = time.perf_counter()
    sched.run(reqs)
    sync(llm)
    wall = time.perf_counter() - t0
    sched.step()  # the boundary after the last step (and the step in flight read)
    assert sched.idle and sched.blocks.used == 0, "blocks left held"
    return [r.out for r in reqs], wall, len(sched.history) - 1, step_summary(sched)["tree_sizes"]


def logit_gap(llm: LLM, prefix: list[int], a: int, b: int) -> float:
    """logit(a) - logit(b) of the target's next token after `prefix`, alone (its own single-sequence cache)."""
    t, dev = llm.target, llm.device
    pos = torch.arange(len(prefix), device=dev)
    h = t(torch.tensor(prefix, device=dev), pos, pos, Span(torch.tensor(0, device=dev), causal(len(prefix), dev),
                                                         len(prefix)))
    logits = t.logits(h[-1:])[0].float()
    return float(logits[a] - logits[b])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="qwen2.5-coder-1.5b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--longest", type=int, default=1024, help="longest prompt (random ids; the shortest is 16)")
    ap.add_argument("--new-tokens", type=int, default=256, help="largest budget (the smallest is an eighth of it)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", help="float32: the outputs must match; bfloat16: timing only "
                    "(a finished request leaves a step later with overlap, so batches differ and bf16 rounds "
                    "differently)")
    ap.add_argument("--compare", choices=("overlap", "packed-graphs"), default="overlap",
                    help="what is switched off and on: the overlapped step, or the graphs of packed passes")
    ap.add_argument("--method", default="ar", help="ar, or a speculative method (--compare overlap: its plain "
                    "decode-only steps overlap, its rounds and prompt steps do not; packed-graphs: its packed passes)")
    ap.add_argument("--draft", help="the speculative method's head (default: a random EAGLE-3 head of 32k ids)")
    ap.add_argument("--spec-policy", default="auto", help="auto: plain decode rows join the packed passes; fixed: "
                    "every decode step a round, the packed passes hold prompt chunks only")
    a = ap.parse_args()
    draft = a.draft
    if a.method != "ar" and draft is None:
        draft = Path(tempfile.mkdtemp())
        random_head(resolve_engine(a.engine), draft, 32768)
    llm = LLM(a.engine, a.method, draft=draft, device=a.device, dtype=a.dtype, max_batch=a.max_batch,
              spec_policy=a.spec_policy)
    sched = llm.scheduler()
    ids, budgets, params = workload(a.requests, llm.target.cfg.vocab_size, a.longest, a.new_tokens)
    outs = {}
    for on in (False, True):  # one engine: only the scheduling, or the packed passes' graphs, differ
        if a.compare == "overlap":
            sched.overlap = on
        else:
            sched.runner.graph_rows = GRAPHED_ROWS if on else 0
        run(llm, ids, budgets, params)  # warm: every graph bucket captured
        out, wall, steps, trees = run(llm, ids, budgets, params)
        outs[on] = out
        tokens = sum(map(len, out))
        # steps per tree size (1: plain): `auto` picks from measured step times, so two runs can pick differently,
        # and a sampled request's draws then differ (each is the target's distribution, not the same draw);
        # greedy requests must be equal whatever was picked
        print(f"{a.compare} {'on ' if on else 'off'}: {tokens} tokens in {wall:.2f} s = {tokens / wall:,.0f} output "
              f"tok/s, {steps} steps ({wall / steps * 1e3:.2f} ms a step); steps per tree size {trees}", flush=True)
    diff = [i for i, (x, y) in enumerate(zip(outs[False], outs[True])) if x != y]
    print(f"greedy outputs equal with {a.compare} on and off: {not [i for i in diff if params[i].greedy]}")
    print(f"outputs equal with {a.compare} on and off: {not diff}" + (f" ({len(diff)} differ, first {diff[:8]})"
                                                                        if diff else ""))
    for i in diff[:8]:
        x, y = outs[False][i], outs[True][i]
        j = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        line = f"  request {i} ({'greedy' if params[i].greedy else 'sampled'}): first differs at token {j} " \
               f"({len(x)} tokens off, {len(y)} on)"
        if j < min(len(x), len(y)):
            line += f": {x[j]} off, {y[j]} on"
            if params[i].greedy:
                line += f"; logit gap there (off - on) {logit_gap(llm, ids[i] + x[:j], x[j], y[j]):.3g}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
