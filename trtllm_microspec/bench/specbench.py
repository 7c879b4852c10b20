"""`microspec bench`: Spec-Bench (6 categories) + HumanEval (code), every method on the same questions.

Measurement follows Spec-Bench: chat template, greedy (or sampled with --temperature), warm-up runs, `synchronize(); perf_counter()` around each
request (prefill included); a question's speed = its new tokens / its wall time over all its turns, a category's
speed = the mean over its questions, speedup = method mean speed / AR mean speed of the same run. MT-bench's second
turn is generated in the context [user 1, the model's own answer 1, user 2]. Every method's tokens are compared with
AR's on the fly (speculative decoding is lossless; mismatches are counted and listed, never fatal); sampled outputs
differ from AR's by design and are not compared (their losslessness in distribution is tests/test_sampling.py's).
"""
from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from .. import parallel
from ..engine.stats import load_times, percentiles
from ..models.registry import UserError, check_out_dir
from .references import HF, HF_COMPILED, REFERENCES, VLLM, VLLM_EAGLE, make_reference, require_vllm

SPEC_BENCH = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
CATEGORIES = SPEC_BENCH + ("code",)
# Spec-Bench reports MT-bench's 8 categories as one
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
WINDOWS = ("microspec", "microspec-paper")  # the W_max sweep's methods: the filled window and the paper's
WARMUP_TOKENS = 64  # warm-up only has to touch every kernel and allocation once, not generate a full answer
WARM_PASSES = 3  # unmeasured passes over the measured turns at most, until one meets no new CUDA-graph key


# Spec-Bench's question.jsonl (Apache-2.0) and HumanEval (MIT) ship inside the package, with their licences
PACKAGED_DATA = Path(__file__).resolve().parents[1] / "evaldata"


def data_dir(arg: str | None) -> Path:
    """--data, else $MICROSPEC_DATA, else the packaged copy; a directory with spec_bench/ (and humaneval/)."""
    d = Path(arg or os.environ.get("MICROSPEC_DATA") or PACKAGED_DATA)
    if not (d / "spec_bench" / "question.jsonl").exists():
        raise UserError(f"no Spec-Bench data at {d}/spec_bench/question.jsonl: pass --data DIR or set MICROSPEC_DATA")
    return d


def load_questions(data: Path, categories: list[str], limit: int | None) -> list[dict]:
    """[{qid, category, turns}], the first `limit` of each category; MT-bench round-robin over its 8 sub-categories
    so that a small limit still samples all of them."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    seen: dict[str, int] = defaultdict(int)
    for line in (data / "spec_bench" / "question.jsonl").read_text().splitlines():
        q = json.loads(line)
        cat = "mt_bench" if q["category"] in MT_BENCH else q["category"]
        by_cat[cat].append({"qid": str(q["question_id"]), "category": cat, "turns": q["turns"],
                            "order": seen[q["category"]]})
        seen[q["category"]] += 1
    by_cat["mt_bench"].sort(key=lambda q: q["order"])
    if "code" in categories:
        f = data / "humaneval" / "HumanEval.jsonl.gz"
        if not f.exists():
            raise UserError(f"no HumanEval data at {f}")
        with gzip.open(f, "rt") as fh:
            by_cat["code"] = [{"qid": p["task_id"], "category": "code",
                               "turns": [f"Complete the following Python function:\n```python\n{p['prompt']}```"]}
                              for p in map(json.loads, fh)]
    return [q for c in categories for q in by_cat[c][:limit]]


def build_runs(a) -> list[dict]:
    """One entry per model configuration to measure: AR first, as every other run is compared with it, the outside
    references (hf, hf-compiled, vllm, vllm-eagle) last. A sweep point equal to the main run's setting is not run
    twice."""
    # a speculative method may name its speculation policy: microspec@fixed, microspec@auto (else --spec-policy's)
    runs = [{"label": m, "method": m.split("@")[0], **({"spec_policy": m.split("@")[1]} if "@" in m else {})}
            for m in dict.fromkeys(["ar", *a.methods]) if m not in REFERENCES]
    runs += [{"label": f"frspec@K={k}", "method": "frspec", "static_k": k}
             for k in a.frspec_k if not (k == a.static_k and "frspec" in a.methods)]
    windows = [m for m in WINDOWS if m in a.methods] or ["microspec"]  # each window listed sweeps W_max
    runs += [{"label": f"{m}@W={w}", "method": m, "w_max": w}
             for m in windows for w in a.w_max_sweep if not (w == a.w_max and m in a.methods)]
    runs += [{"label": m, "method": m} for m in dict.fromkeys(a.methods) if m in REFERENCES]
    for r in runs:
        r.setdefault("static_k", a.static_k)
        r.setdefault("w_max", a.w_max)
    return runs


def make_model(a, run: dict):
    if run["method"] in REFERENCES:
        return make_reference(run["method"], a)
    from ..cli import llm_from_args

    batch = {"max_batch": max(a.concurrency)} if a.concurrency else {}  # else the LLM's default
    return llm_from_args(argparse.Namespace(**{**vars(a), "w_max": run["w_max"], "static_k": run["static_k"], **batch,
                                               "spec_policy": run.get("spec_policy", a.spec_policy)}),
                         method=run["method"])


def timed(model, messages, max_new_tokens: int, cuda: bool, sampling: dict):
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = model.generate(messages, max_new_tokens, chat=True, **sampling)
    if cuda:
        torch.cuda.synchronize()
    return r, time.perf_counter() - t0


def first_uses(model) -> int:
    """The model's CUDA-graph first uses so far (LLM.graph_first_uses); 0 for an outside reference (vLLM captures its
    graphs at start-up)."""
    return getattr(model, "graph_first_uses", lambda: 0)()


def step_costs_note(where: str, costs: list[dict]) -> str:
    """One line of what the speculation policy weighed (LLM.step_costs): per shape its step time (- where not
    measured) and prior tokens a round, and so its prior tokens per ms."""
    parts = []
    for c in costs:
        ms = c["seconds"] and c["seconds"] * 1e3
        name = "plain" if c["tokens"] == 1 else f"{c['tokens']}-token tree"
        rate = f" = {c['prior'] / ms:.2f} tokens/ms" if ms else ""
        parts.append(f"{name} {_fmt(ms, '.2f')} ms for {c['prior']:.2f} tokens{rate}")
    return f"{where}: the policy's step costs (calibrated, corrected by the steps run) and prior tokens: " + \
        "; ".join(parts)


def first_use_note(where: str, n: int, after: str = "") -> str:
    return f"{where}: {n} CUDA-graph first uses (an eager step or a capture) in the measured pass{after}: not quite " \
           f"the steady state"


def run_questions(model, questions: list[dict], a, label: str, sampling: dict) -> tuple[list[dict], dict, dict]:
    """Per turn: a record of its stats and timing; also the token ids per (qid, turn) for the comparisons, and how
    the steady state was reached (`warm`: unmeasured passes, CUDA-graph first uses left in the measured one)."""
    cuda = model.device.type == "cuda"
    first = questions[0]["turns"][0]
    log(f"{label}: {a.warmup} warm-up requests")
    for _ in range(a.warmup):  # sampled like the measured requests: sampling runs its own CUDA graphs
        model.generate(first, min(a.max_new_tokens, WARMUP_TOKENS), chat=True, **sampling)
    passes = 0
    while a.warmup and passes < WARM_PASSES:  # every measured turn, unmeasured, until a pass meets no new graph
        # key: the steady state is measured. vLLM captures its graphs at start-up, outside its measurement; here a
        # key's first use costs an eager step and a capture (on the H200 18-60 ms each, where a step takes 2-4).
        # One pass captures all that `fixed` meets, but under `auto` the keys (tree shape, KV-span bucket, catch-up
        # or not) follow the policy's choices, which follow its state: a second pass can meet keys the first did
        # not. No first-time cost of a prompt shape (kernel compiles, attention plans) falls on the first method.
        before = first_uses(model)
        converse(model, questions, a, cuda, sampling)
        passes += 1
        if first_uses(model) == before:
            break
    before = first_uses(model)
    records, ids = converse(model, questions, a, cuda, sampling, label)
    return records, ids, {"passes": passes, "graph_first_uses": first_uses(model) - before}


def converse(model, questions: list[dict], a, cuda: bool, sampling: dict, label: str | None = None):
    """Every question's turns in order, each answer joining the conversation: per turn a record of its stats and
    timing, and the token ids per (qid, turn) (label: logged as it goes)."""
    records, ids = [], {}
    for i, q in enumerate(questions, 1):
        messages = []
        for t, user in enumerate(q["turns"]):
            messages.append({"role": "user", "content": user})
            r, secs = timed(model, messages, a.max_new_tokens, cuda, sampling)
            messages.append({"role": "assistant", "content": r.text})
            records.append({"qid": q["qid"], "category": q["category"], "turn": t, "time_s": secs, **r.stats})
            ids[q["qid"], t] = r.token_ids
        done = records[-len(q["turns"]):]
        if label:
            log(f"{label}: question {i}/{len(questions)} ({q['category']}): {sum(r['new_tokens'] for r in done)} "
                f"tokens in {sum(r['time_s'] for r in done):.1f} s")
    return records, ids


def level_questions(questions: list[dict], a, c: int) -> list[dict]:
    """The first turns level c decodes: every question's; with --requests-per-level K, K x c of them, with
    --requests N exactly N, taken in turn and repeated past the last (so a level above the question count still
    holds K requests per slot; neither system caches prefixes here, so a repeat costs what a new prompt does). Both
    take them round-robin over the categories, so that every level samples all of them."""
    k, n = getattr(a, "requests_per_level", None), getattr(a, "requests", None)
    if not (k or n):
        return questions
    rank: dict[str, int] = defaultdict(int)
    order = []
    for i, q in enumerate(questions):
        order.append((rank[q["category"]], i))
        rank[q["category"]] += 1
    every = [questions[i] for _, i in sorted(order)]
    n = k * c if k else n
    return [every[i % len(every)] for i in range(n)]


def run_batched(model, questions: list[dict], a, label: str, sampling: dict, ar_ids: dict | None) -> list[dict]:
    """--concurrency: every question's first turn submitted at once, at most `c` in flight for each c of the list
    (the rest wait for a slot, and join as others finish): throughput and per-request times per level. Our batched
    engine takes them all with max_batch = c (its scheduler queues the rest); vLLM through its own engine loop, the
    next one added as one finishes (its max_num_seqs is the largest c). Both sides' times are the bench's, on one
    clock and by one definition (engine/stats.py load_times): every request of a level is submitted at t0, the time
    the bench hands the level to the system, so TTFT and latency count from t0, queueing for a slot included, and
    ITL comes from the times each step's tokens reached the host (Result.emits). ar_ids (greedy): AR's tokens per
    (qid, turn), which each request of a batch must emit alone; its level counts those that differ (None without
    them: --batched-only)."""
    ours = hasattr(model, "scheduler")
    out = []
    every = questions
    for c in a.concurrency:
        questions = level_questions(every, a, c)
        prompts = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
        if ours:
            model.scheduler().max_batch = c  # the runner is sized for the largest level

        fallback = []

        def go():
            if ours or fallback:
                return model.generate(prompts, a.max_new_tokens, chat=True, **sampling)
            try:
                return model.generate_at(prompts, a.max_new_tokens, c)
            except (AttributeError, TypeError, KeyError) as e:  # a vLLM whose engine loop differs: measured still
                log(f"{label}: vLLM's engine loop failed ({type(e).__name__}: {e}); every request at once instead, "
                    f"no per-request times")
                fallback.append(True)
                return model.generate(prompts, a.max_new_tokens, chat=True)

        if a.warmup:  # the measured run once before, sampled alike: it meets the same (batch, span, sampling mode)
            # buckets (exactly the same when greedy or seeded), so the CUDA graphs it needs are captured here (a first
            # capture costs more than a whole step; vLLM captures at start-up, outside its measurement)
            go()
        cuda = model.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        if ours:
            model.scheduler().history.clear()  # the record of this pass only
        uses = first_uses(model)
        t0 = time.perf_counter()
        results = go()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        s = batch_summary(questions, results, t0, wall, c)
        # every request against AR's tokens for its question (a repeat of --requests too)
        s["mismatches"] = None if not ar_ids else sum(r.token_ids != ar_ids[q["qid"], 0]
                                                      for q, r in zip(questions, results))
        if ours:
            s["steps"] = step_summary(model.scheduler(), t0)
            rounds = sum(r.stats.get("rounds") or 0 for r in results)  # speculative rounds (no plain steps)
            s["acceptance_length"] = sum(r.stats.get("round_tokens") or 0 for r in results) / rounds if rounds \
                else None
            # requests that decoded as AR's: no tree paid at the batch they joined (SpecRunner.shares_prefix)
            s["steps"]["as_ar"] = sum(1 for r in results if r.stats.get("speculative") is False)
            # steps that met a CUDA-graph key the warm-up pass did not (an eager step or a capture): not steady
            s["steps"]["graph_first_uses"] = first_uses(model) - uses
            # what the speculation policy weighed at this level (why it speculated or not)
            s["steps"]["step_costs"] = model.step_costs(c)
        if fallback:
            s["all_at_once"] = True
        log(f"{label}: {len(prompts)} first turns at concurrency {c}: {s['requests_per_s']:.2f} req/s, "
            f"{s['output_tokens_per_s']:.1f} output tok/s, TTFT p50 from submission "
            f"{_fmt(s['ttft_s']['p50'], '.3f')} s, "
            f"ITL p50 {_fmt(s['itl_s']['p50'] and s['itl_s']['p50'] * 1e3, '.2f')} ms")
        out.append(s)
    return out


def step_summary(sched, t0: float | None = None) -> dict:
    """The measured pass's steps from the scheduler's record: how many, how many ran prompt chunks, the rows
    of target work per step, preemptions, the host time per step, and (t0: the level's submission) how long the
    submission took before the first step began and the steps' time in all (the rest of the wall: between steps)."""
    recs = list(sched.history)
    ran = [r for r in recs if r.tokens]
    at = {} if t0 is None or not recs else {"first_step_ms": (recs[0].start - t0) * 1e3,
                                             "steps_total_ms": sum(r.step_s for r in recs) * 1e3}
    return {"steps": len(ran), "mixed_steps": sum(1 for r in ran if r.chunks), **at,
            "tokens_per_step": percentiles([r.tokens for r in ran]),
            "preempted": sum(r.preempted for r in recs),
            "step_ms": percentiles([r.step_s * 1e3 for r in ran]),
            # the speculation policy's choices: decoding steps per tree size (1: plain decoding)
            "tree_sizes": {t: sum(1 for r in ran if r.tree == t) for t in sorted({r.tree for r in ran if r.tree})}}


def batch_summary(questions: list[dict], results: list, t0: float, wall: float, concurrency: int) -> dict:
    """A level's results, every request submitted at t0 (perf_counter), each with the times its tokens reached the
    host (Result.emits; None: no per-request times, as vLLM's all-at-once fallback): throughput over the level's
    wall time, and TTFT / ITL / latency percentiles from `load_times`, the one definition both systems are timed by."""
    times, each = load_times([(t0, r.emits or []) for r in results])
    per_request = [{"qid": q["qid"], "new_tokens": r.num_new_tokens, "ttft_s": e["ttft_s"], "latency_s": e["latency_s"]}
                   for q, r, e in zip(questions, results, each)]
    tokens = sum(r["new_tokens"] for r in per_request)
    return {"concurrency": concurrency, "requests": len(per_request), "wall_s": wall,
            "requests_per_s": len(per_request) / wall, "output_tokens_per_s": tokens / wall, **times,
            "per_request": per_request}


def summarize(records: list[dict]) -> dict:
    per_q: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for r in records:
        per_q[r["qid"]][0] += r["new_tokens"]
        per_q[r["qid"]][1] += r["time_s"]
    speeds = [n / s for n, s in per_q.values()]
    rounds = sum(r.get("rounds", 0) for r in records)  # speculative rounds (the policy's plain steps are none)
    emitted = sum(r.get("round_tokens", 0) for r in records)
    # weighted by the tokens its rounds emitted, over which a turn's coverage is counted
    covered = [(r["coverage"], r["round_tokens"]) for r in records if r.get("coverage") is not None]
    plain = sum(r.get("plain_steps") or 0 for r in records)  # the speculation policy's plain steps
    reasons: dict = defaultdict(int)
    for r in records:
        for why, n in (r.get("plain_reasons") or {}).items():
            reasons[why] += n
    return {
        "questions": len(per_q),
        "turns": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "speed": sum(speeds) / len(speeds),
        "acceptance_length": emitted / rounds if rounds else None,
        # None: the engine runs a round as one launch (the profile splits its phases)
        "draft_share": sum(r["draft_s"] for r in records if r.get("draft_s") is not None) / sum(
            r["time_s"] for r in records) if any(r.get("draft_s") is not None for r in records) else None,
        "vocab_mean": sum(r["vocab_mean"] * r["rounds"] for r in records if r.get("rounds")) / rounds if rounds else None,
        "coverage": sum(c * n for c, n in covered) / max(1, sum(n for _, n in covered)) if covered else None,
        "plain_share": plain / (plain + rounds) if plain + rounds else None,  # of the decoding steps
        "plain_reasons": dict(reasons),
    }


def compare(ids: dict, ref: dict) -> list[dict]:
    """Turns whose tokens differ from AR's, with the first differing position."""
    out = []
    for key, toks in ids.items():
        want = ref[key]
        if toks != want:
            pos = next((i for i, (x, y) in enumerate(zip(toks, want)) if x != y), min(len(toks), len(want)))
            out.append({"qid": key[0], "turn": key[1], "first_diff": pos, "len": len(toks), "ar_len": len(want)})
    return out


def static_coverage(ar_ids: dict, questions: list[dict], ranked: torch.Tensor, vocab_size: int) -> dict:
    """FR-Spec's coverage offline: the share of AR-emitted tokens (the first of each turn excluded, as online)
    inside the top-K ranked ids, for K in powers of two up to the vocabulary."""
    rank = torch.full((vocab_size,), vocab_size, dtype=torch.long)
    rank[ranked.long()] = torch.arange(ranked.numel())
    ks = [k for k in (2 ** i for i in range(9, 20)) if k < vocab_size] + [vocab_size]
    cat_of = {q["qid"]: q["category"] for q in questions}
    toks: dict[str, list[int]] = defaultdict(list)
    for (qid, _), t in ar_ids.items():
        toks[cat_of[qid]] += t[1:]
        toks["overall"] += t[1:]
    out = {"k": ks}
    for cat, t in toks.items():
        r = rank[torch.tensor(t, dtype=torch.long)] if t else torch.empty(0, dtype=torch.long)
        out[cat] = [float((r < k).float().mean()) if t else None for k in ks]
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


METRICS = [("speed", "tokens/s (prefill included)", ".1f"), ("speedup", "speedup over AR", ".2f"),
           ("acceptance_length", "mean acceptance length", ".2f"), ("draft_share", "share of time in drafting", ".1%"),
           ("vocab_mean", "mean active draft vocabulary", ".0f"), ("coverage", "coverage (emitted tokens in the draft vocabulary)", ".1%"),
           ("plain_share", "share of decoding steps run plain (the speculation policy's; why: below)", ".1%")]


def markdown(res: dict) -> str:
    cols = res["categories"] + ["overall"]
    runs = res["runs"]
    lines = [f"# Spec-Bench + HumanEval: {res['config']['engine']} on {res['device']}", "",
             f"max_new_tokens {res['config']['max_new_tokens']}, limit {res['config']['limit']} per category, "
             f"{sampling_text(res['config'])}, chat template; speed = mean over questions of new tokens / wall time.", ""]
    if any(r["summary"] for r in runs.values()):  # --batched-only runs have no per-question tables
        for key, title, spec in METRICS:
            lines += [f"## {title}", "", "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            lines += [f"| {name} | " + " | ".join(_fmt(run["summary"][c][key], spec) for c in cols) + " |"
                      for name, run in runs.items() if run["summary"]]
            lines.append("")
        lines += ["## why steps ran plain (overall: plain steps per reason)", "",
                  "cost: at the prior acceptance no tree pays for its measured cost; acceptance: a tree would, but "
                  "not at the acceptance the requests showed. Acceptance, vocabulary and coverage are over the "
                  "speculative rounds only (-: none ran).", "", "| method | plain steps | reasons |", "|---|---|---|"]
        lines += [f"| {n} | {sum(why.values())} | " + (", ".join(f"{k}: {v}" for k, v in sorted(why.items())) or "-")
                  + " |" for n, r in runs.items() if r["summary"]
                  for why in [r["summary"]["overall"].get("plain_reasons") or {}]]
        lines += ["", "## losslessness (token ids equal to AR's)", "", "| method | turns | mismatches |", "|---|---|---|"]
        lines += [f"| {n} | {r['summary']['overall']['turns']} | {len(r['mismatches'])} |" for n, r in runs.items()
                  if r["summary"]]
    for method, knob in (("frspec", "static_k"), *((m, "w_max") for m in WINDOWS)):
        sweep = sorted((r for r in runs.values() if r["method"] == method and r["summary"]), key=lambda r: r[knob])
        if len(sweep) > 1:
            lines += ["", f"## {method} sweep over {knob} (overall)", "",
                      f"| {knob} | " + " | ".join(t for _, t, _ in METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
            lines += [f"| {r[knob]} | " + " | ".join(_fmt(r["summary"]["overall"][k], s) for k, _, s in METRICS) + " |"
                      for r in sweep]
    batched = {n: r["batched"] for n, r in runs.items() if r.get("batched")}
    if batched:
        ms = lambda p: " | ".join(_fmt(p[k] and p[k] * 1e3, ".1f") for k in ("p50", "p90", "p99"))
        lines += ["", "## in-flight batching (first turns, all submitted at once, at most `concurrency` in flight)", "",
                  ("TTFT from submission, queueing included, both systems: every request of a level is submitted "
                   "when the bench hands the level over, and TTFT = its first token's time - that, latency = its "
                   "last token's time - that, on one clock, computed by one function for every system (the times "
                   "a step's tokens reach the host). Inter-token latency (ITL): over every token "
                   "after a request's first, the time between the two steps that emitted it and the one before, "
                   "shared by the tokens of the later step (a speculative round emits several at once). Our engine "
                   "takes every request with max_batch = concurrency (the rest queue in its scheduler); vLLM runs "
                   "through its own engine loop, the bench adding the next request as one finishes (at most that "
                   "many in flight; its max_num_seqs = the largest level). Differ from AR: greedy requests "
                   "whose tokens are not AR's alone (fp32: none; bf16: near ties, as batch shapes change the sums; "
                   "- with --batched-only). Steps: our engine's steps (those with prompt chunks), target rows per "
                   "step p50 / p99, requests preempted, host time per step p50 (ms); decoding steps per tree size "
                   "(1: plain), and the MicroSpec prompts whose windows started without top-K_pre (no tree paid "
                   "at the batch they joined)."), "",
                  "| method | concurrency | requests | req/s | output tok/s | TTFT from submission p50 | p90 | p99 (ms) "
                  "| ITL p50 | p90 | p99 (ms) | latency from submission p50 | p90 | p99 (ms) | differ from AR | "
                  "steps (mixed) | rows/step p50 / p99 | preempted | step ms p50 | acceptance | decoding steps per "
                  "tree size |", "|---" * 21 + "|"]
        lines += [f"| {n} | {b['concurrency']} | {b['requests']} | {b['requests_per_s']:.2f} | "
                  f"{b['output_tokens_per_s']:.1f} | {ms(b['ttft_s'])} | {ms(b['itl_s'])} | {ms(b['latency_s'])} | "
                  f"{_fmt(b.get('mismatches'), 'd')} | {steps_cells(b.get('steps'))} | "
                  f"{_fmt(b.get('acceptance_length'), '.2f')} | {tree_cell(b.get('steps'))} |"
                  for n, levels in batched.items() for b in levels]
    cov = res.get("static_coverage")
    if cov:
        cats = [c for c in cols if c in cov]
        lines += ["", "## static top-K coverage of the AR output (FR-Spec's ranking, offline)", "",
                  "| K | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(_fmt(cov[c][i], ".1%") for c in cats) + " |" for i, k in enumerate(cov["k"])]
    lines += ["", *[f"- {n}" for n in res["notes"]]]
    return "\n".join(lines) + "\n"


def steps_cells(st: dict | None) -> str:
    if not st:
        return "- | - | - | -"
    return (f"{st['steps']} ({st['mixed_steps']}) | {_fmt(st['tokens_per_step']['p50'], '.0f')} / "
            f"{_fmt(st['tokens_per_step']['p99'], '.0f')} | {st['preempted']} | {_fmt(st['step_ms']['p50'], '.2f')}")


def tree_cell(st: dict | None) -> str:
    """{60: 812, 1: 40} -> "60: 812, 1: 40" (tree tokens: decoding steps); "-" for vLLM."""
    if not st or not st.get("tree_sizes"):
        return "-"
    cell = ", ".join(f"{t}: {n}" for t, n in sorted(st["tree_sizes"].items(), key=lambda x: -int(x[0])))
    return cell + (f"; {st['as_ar']} requests as AR's" if st.get("as_ar") else "")


def sampling_text(config: dict) -> str:
    if not config.get("temperature"):
        return "greedy"
    return (f"sampled at temperature {config['temperature']}, top-p {config['top_p']}, top-k {config['sample_top_k']}, "
            f"seed {config['seed']}")


def cmd_bench(a) -> None:
    from ..cli import sampling_from_args
    from ..vocab.strategies import METHODS

    sampling = sampling_from_args(a)  # checked even when greedy
    if not sampling["temperature"]:
        sampling = {}  # greedy: what every run does by default, the outside references too
    elif set(REFERENCES) & set(a.methods):
        raise UserError(f"the outside references ({', '.join(REFERENCES)}) run greedy only: leave them out of "
                        f"--methods when sampling")

    from ..engine.policy import POLICIES
    for m in a.methods:
        if m not in METHODS + REFERENCES and not (m.split("@")[0] in METHODS and m.split("@")[-1] in POLICIES):
            raise UserError(f"unknown method {m!r}; choose from {', '.join(METHODS + REFERENCES)} (a method may "
                            f"end in @{'/@'.join(POLICIES)}: its speculation policy)")
    if {VLLM, VLLM_EAGLE} & set(a.methods):
        require_vllm()  # before any run: the whole benchmark was asked for with it
    if not a.categories:
        raise UserError(f"--categories is empty; choose from {', '.join(CATEGORIES)}")
    for c in a.categories:
        if c not in CATEGORIES:
            raise UserError(f"unknown category {c!r}; choose from {', '.join(CATEGORIES)}")
    if a.limit is not None and a.limit < 1:
        raise UserError("--limit must be at least 1")
    if a.warmup < 0:
        raise UserError(f"--warmup must be at least 0, got {a.warmup}")
    check_out_dir(a.out)
    if a.server and not a.concurrency:
        raise UserError("--server measures a running server under load: give --concurrency too")
    if a.requests_per_level is not None and (a.requests_per_level < 1 or not a.concurrency):
        raise UserError("--requests-per-level must be at least 1, with --concurrency")
    if a.requests is not None and (a.requests < 1 or not a.concurrency or a.requests_per_level):
        raise UserError("--requests must be at least 1, with --concurrency and without --requests-per-level")
    if a.batched_only and not a.concurrency:
        raise UserError("--batched-only measures the --concurrency levels only: give --concurrency")
    if a.concurrency is not None and not a.server:
        unbatched = [m for m in a.methods if m in (HF, HF_COMPILED)]
        if not a.concurrency or min(a.concurrency) < 1:
            raise UserError("--concurrency must be a comma list of numbers of at least 1")
        if unbatched:
            raise UserError(f"--concurrency runs the batched engine, which runs every method (and vLLM batches), "
                            f"not {', '.join(unbatched)}")
        if a.tp > 1:
            raise UserError("--concurrency runs the batched engine, on one device (no --tp)")
    from ..cli import resolve_tree

    resolve_tree(a)  # recorded in the results: the device's tree unless given
    questions = load_questions(data_dir(a.data), a.categories, a.limit)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.server:
        return served_load(a, questions, sampling, out)
    res = {"config": {k: v for k, v in vars(a).items() if k != "func"}, "categories": a.categories,
           "runs": {}, "notes": []}
    ar_ids: dict = {}
    runs = build_runs(a)
    log(f"{len(questions)} questions ({', '.join(a.categories)}), {len(runs)} runs: "
        f"{', '.join(r['label'] for r in runs)}")
    for i, run in enumerate(runs, 1):
        label = run.pop("label")
        if run["method"] in (HF, HF_COMPILED) and importlib.util.find_spec("transformers") is None:
            res["notes"].append(f"{label} skipped: transformers is not installed")
            log(res["notes"][-1])
            continue
        log(f"run {i}/{len(runs)} {label}: loading the model")
        model = make_model(a, run)
        t0 = time.perf_counter()
        records, ids, warm = ([], {}, None) if a.batched_only else run_questions(model, questions, a, label, sampling)
        if warm and warm["graph_first_uses"]:
            res["notes"].append(first_use_note(label, warm["graph_first_uses"],
                                               f", after {warm['passes']} unmeasured passes"))
        if run["method"] == "ar":
            ar_ids = ids
            res["device"] = str(model.device)
            if not a.batched_only:
                res["static_coverage"] = static_coverage_of(model.engine_dir, ar_ids, questions, res["notes"])
        batched = run_batched(model, questions, a, label, sampling, None if sampling else ar_ids) if a.concurrency \
            else None
        for level in batched or []:
            n = level.get("steps", {}).get("graph_first_uses")
            if n:
                res["notes"].append(first_use_note(f"{label} at concurrency {level['concurrency']}", n))
            costs = level.get("steps", {}).get("step_costs")
            if costs:
                res["notes"].append(step_costs_note(f"{label} at concurrency {level['concurrency']}", costs))
        if hasattr(model, "close"):  # vLLM frees its process-wide state only when asked
            model.close()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        mism = [] if sampling else compare(ids, ar_ids)
        summary = None
        if records:
            summary = {c: summarize([r for r in records if r["category"] == c]) for c in a.categories}
            summary["overall"] = summarize(records)
            ar = res["runs"]["ar"]["summary"] if res["runs"] else summary  # the first run is AR's
            for c, s in summary.items():
                s["speedup"] = s["speed"] / ar[c]["speed"]
            s = summary["overall"]
            log(f"{label}: {s['speed']:.1f} tok/s, {s['new_tokens']} tokens in {len(questions)} questions, "
                f"{len(mism)} mismatches with AR ({time.perf_counter() - t0:.0f} s)")
        else:
            log(f"{label}: done ({time.perf_counter() - t0:.0f} s)")
        res["runs"][label] = {**run, "lossless": None if sampling or not records else not mism, "mismatches": mism,
                              "summary": summary, "turns": records, "batched": batched, "warm": warm}
        if parallel.rank() == 0:  # under --tp every rank measures the same run; rank 0 reports it
            write(res, out)  # after every run, so that an interrupted benchmark still leaves what it measured
    if parallel.rank() == 0:
        print(out / "results.md")


def served_load(a, questions: list[dict], sampling: dict, out: Path) -> None:
    """--server URL --concurrency ...: every question's first turn (chat) sent to a running `microspec serve`, over
    gRPC (host:port) or its OpenAI endpoint (http://host:port/v1), at most c at once per level: the client's view
    (`microspec client` load mode's report), so that both APIs can be compared on the same server and prompts."""
    from ..serving.client import load

    # the model's sampling inputs (TensorRT-LLM's names); greedy: none
    kw = dict(chat=True, stream=True, sampling={("random_seed" if k == "seed" else k): v
                                                for k, v in sampling.items() if v is not None})
    res = {"config": {k: v for k, v in vars(a).items() if k != "func"}, "server": a.server, "levels": []}
    for c in a.concurrency:
        prompts = [q["turns"][0] for q in level_questions(questions, a, c)]
        if a.warmup:  # the same requests once, unmeasured: the server captures the CUDA graphs they need
            load(a.server, prompts, c, len(prompts), a.max_new_tokens, **kw)
        r = load(a.server, prompts, c, len(prompts), a.max_new_tokens, **kw)
        log(f"{a.server}: {r['completed']}/{r['requests']} first turns at concurrency {c}: "
            f"{r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s")
        for e in sorted(set(r["errors"])):
            log(f"error ({r['errors'].count(e)}x): {e}")
        res["levels"].append(r)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    ms = lambda p: " | ".join(_fmt(p[k] and p[k] * 1e3, ".1f") for k in ("p50", "p90", "p99"))  # noqa: E731
    lines = [f"# Spec-Bench first turns against {a.server}", "",
             f"max_new_tokens {a.max_new_tokens}, {sampling_text(res['config'])}, chat template, streamed; times "
             "seen by the client (TTFT from sending; ITL: a request's (last piece - first piece) / (tokens - 1)).", "",
             "| concurrency | completed | req/s | output tok/s | TTFT p50 | p90 | p99 (ms) | ITL p50 | p90 | p99 (ms) | "
             "latency p50 | p90 | p99 (ms) | acceptance |", "|---" * 14 + "|"]
    lines += [f"| {r['concurrency']} | {r['completed']}/{r['requests']} | {r['requests_per_s']:.2f} | "
              f"{r['output_tokens_per_s']:.1f} | {ms(r['ttft_s'])} | {ms(r['itl_s'])} | {ms(r['latency_s'])} | "
              f"{_fmt(r['mean_acceptance_length'], '.2f')} |" for r in res["levels"]]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(out / "results.md")


def log(msg: str) -> None:
    """What the benchmark is doing now: it runs for minutes to hours."""
    if parallel.rank() == 0:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)


def static_coverage_of(engine_dir: Path, ar_ids: dict, questions: list[dict], notes: list[str]) -> dict | None:
    from ..llm import FREQ_FILE

    if not (engine_dir / FREQ_FILE).exists():
        notes.append(f"no {FREQ_FILE} in the engine: no static coverage curve")
        return None
    from safetensors.torch import load_file

    from ..engine.loader import read_config
    return static_coverage(ar_ids, questions, load_file(engine_dir / FREQ_FILE)["ranked_ids"],
                           read_config(engine_dir).vocab_size)


def write(res: dict, out: Path) -> None:
    from .plots import plot_all

    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    notes = plot_all(res, out)
    (out / "results.md").write_text(markdown({**res, "notes": res["notes"] + notes}))


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def register(sub) -> None:
    from ..cli import OVERLAP_HELP, PREFIX_CACHE_HELP, add_llm_args, add_sampling_args

    p = sub.add_parser("bench", help="Spec-Bench + HumanEval: speed, speedup, acceptance, vocabulary per method",
                       description=__doc__)
    add_llm_args(p)  # --method is not used here: --methods lists what to run
    add_sampling_args(p)
    p.add_argument("--methods", type=_names, default=["ar", "eagle", "frspec", "microspec"],
                   help="comma list of ar, eagle, frspec, microspec, microspec-paper, ctx-only, ext-only, naive and "
                        "the outside references hf, hf-compiled, vllm, vllm-eagle (AR always runs)")
    p.add_argument("--categories", type=_names, default=list(CATEGORIES), help=f"comma list of {', '.join(CATEGORIES)}")
    p.add_argument("--limit", type=int, help="questions per category (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3, help="warm-up requests per method, then every measured turn, "
                   f"unmeasured, until a pass meets no new CUDA graph (at most {WARM_PASSES} passes: the steady state is "
                   "measured; the notes count any first use left); with --concurrency, one unmeasured pass of the batch "
                   "per level (0: none)")
    p.add_argument("--frspec-k", type=_ints, default=[], help="FR-Spec sweep: comma list of vocabulary sizes")
    p.add_argument("--w-max-sweep", type=_ints, default=[], help="MicroSpec sweep: comma list of W_max (Fig. 6), "
                   "for each of microspec and microspec-paper in --methods (microspec if neither)")
    p.add_argument("--concurrency", type=_ints, help="also decode every question's first turn through the batched "
                   "engine, at most this many at once (a comma list: one measurement per level): throughput, TTFT "
                   "and inter-token latency")
    p.add_argument("--server", help="with --concurrency: load a running `microspec serve` instead of a model "
                   "here, at its gRPC address (host:port) or OpenAI endpoint (http://host:port/v1); --methods and the "
                   "model options are then the server's")
    p.add_argument("--spec-policy", choices=["auto", "fixed"], help="the batched engine's speculation policy for "
                   "every speculative method not naming its own (METHOD@fixed, METHOD@auto; default: fixed where "
                   "--depth, --tree-top-k or --total-tokens is given, else auto)")
    p.add_argument("--max-num-tokens", type=int, help="the batched engine's tokens of target work per step "
                   "(default: 8192 on CUDA, 1024 on the CPU)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None, help=OVERLAP_HELP)
    # off by default: a load level repeats its questions past the last (--requests), and a cached prompt would
    # measure the cache, not the engine
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=False, help=PREFIX_CACHE_HELP)
    p.add_argument("--requests-per-level", type=int, help="with --concurrency: level c decodes c x this many first "
                   "turns, repeated past the last where there are fewer (default: all of them at every level)")
    p.add_argument("--requests", type=int, help="with --concurrency: every level decodes this many first turns, "
                   "the selected ones in turn, repeated past the last (issue 36's 1,000-request load)")
    p.add_argument("--batched-only", action="store_true", help="with --concurrency: only the batched levels, no "
                   "request-at-a-time run per question (a load sweep in minutes; no per-category tables, and no "
                   "comparison with AR alone)")
    p.add_argument("--data", help="data directory with spec_bench/question.jsonl and humaneval/HumanEval.jsonl.gz "
                   "(default: $MICROSPEC_DATA, else the copy inside the package)")
    p.add_argument("--out", default="bench_out", help="directory for results.json, results.md and the plots")
    p.set_defaults(func=cmd_bench)
