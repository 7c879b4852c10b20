"""The `microspec` command line. Each feature module adds its own sub-commands through `register(sub)`."""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import sys
from pathlib import Path

from .models.registry import DEFAULT_MODEL, MODELS, UserError

# modules that add their own sub-commands through `register(subparsers)`
OVERLAP_HELP = ("the batched engine schedules and launches each AR step (and each plain step of a speculative method) "
                "while the one before runs on the GPU, reading its tokens one step late (default: on; --no-overlap: "
                "synchronous)")
PREFIX_CACHE_HELP = ("the batched engine keeps the KV blocks of requests that ended and starts a new request from "
                     "those holding its prompt's start, prefilling only the rest (a conversation's next turn, a "
                     "shared system prompt): AR's requests and a speculative method's that decode as AR's (default: "
                     "on, bench: off for ours and vLLM alike)")
FEATURE_MODULES = [
    "trtllm_microspec.vocab.frequency",
    "trtllm_microspec.train.train_draft",
    "trtllm_microspec.train.distill",
    "trtllm_microspec.bench.specbench",
    "trtllm_microspec.bench.kernels",
    "trtllm_microspec.bench.profile",
    "trtllm_microspec.serving.server",
    "trtllm_microspec.serving.client",
]


def add_llm_args(p: argparse.ArgumentParser) -> None:
    """Engine, method and MicroSpec knobs, shared by every command that builds an LLM."""
    from .vocab.strategies import METHODS

    p.add_argument("--engine", default=DEFAULT_MODEL, help="engine directory or model key (built on first use)")
    p.add_argument("--draft", help="EAGLE draft directory (default: <engine>/eagle)")
    p.add_argument("--method", default="ar", choices=METHODS)
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--w-max", type=int, default=3072, help="MicroSpec window: the draft may propose the distinct "
                   "ids among the last W_MAX candidates of the stream (from --tree-top-k to the vocabulary size); "
                   "microspec fills the slots they leave free with the most frequent other ids (the engine's "
                   "build-freq ranking, else token id order), microspec-paper leaves them empty")
    p.add_argument("--k-pre", type=int, default=3, help="MicroSpec: the target's top-K ids at every prompt position "
                   "start the window (0: only the prompt's own tokens)")
    p.add_argument("--k-ver", type=int, default=3, help="MicroSpec: the target's top-K ids at every accepted "
                   "position join the window each round (0: only the draft tree's tokens)")
    p.add_argument("--k-tree", type=int, help="MicroSpec: the target's top-K ids at every tree node it verified, "
                   "the rejected ones too, join the window each round (0: none; default: 3 for microspec, 0 for "
                   "microspec-paper and the ablations, the paper's window)")
    p.add_argument("--static-k", type=int, default=32768, help="frspec: the draft may propose the K most frequent "
                   "ids (from --tree-top-k to the vocabulary size)")
    # the tree's knobs default to the device's tree (speculative.tree.tree_for): a 60-token tree costs a CPU several
    # decode steps per verify
    p.add_argument("--depth", type=int, help="draft tree depth: levels the draft grows after its first guess, i.e. "
                   "depth+1 draft calls per round (at least 1; default: 3 on a CPU, 5 on a GPU)")
    p.add_argument("--tree-top-k", dest="top_k", metavar="TREE_TOP_K", type=int, help="draft tree width: guesses "
                   "kept per node and nodes grown per level (at least 1; LLM's top_k; default: 4 on a CPU, 10 on a "
                   "GPU)")
    p.add_argument("--total-tokens", type=int, help="draft tree size, the root included: tokens the target checks "
                   "in one pass per round (2 to 1 + top_k + depth*top_k^2; default: 12 on a CPU, 60 on a GPU)")
    p.add_argument("--max-seq-len", type=int, help="most tokens, prompt and output together, one request may hold "
                   "(the KV cache length; default and upper bound: the engine's)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (debugging, ablation)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel ranks, one GPU each: run under "
                   "`mpirun -n TP` (heads, MLP and vocabulary split across them)")
    p.add_argument("--tp-timeout", type=float, default=300, help="seconds a rank waits for the others in a "
                   "collective before it ends with an error (a rank that died or hangs)")


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """The batched engine's knobs (generate --prompts-file, serve)."""
    p.add_argument("--max-batch", type=int, help="most requests decoded together (generate: with --prompts-file; "
                   "serve: per instance); the others wait for a place (default: 256 on CUDA, 16 on the CPU)")
    p.add_argument("--max-num-tokens", type=int, help="tokens of target work per step of the batched engine: prompt "
                   "chunks and decode rows in one pass, a tree's rows taking from the prompts' share (default: 8192 "
                   "on CUDA, 1024 on the CPU, at least max-batch; the same for every method)")
    p.add_argument("--kv-memory", type=float, help="the KV-cache pool the batch shares, a fraction of free GPU "
                   "memory when <= 1, else GiB (CPU: GiB; default 0.5)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None, help=OVERLAP_HELP)
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True, help=PREFIX_CACHE_HELP)
    p.add_argument("--spec-policy", choices=["auto", "fixed"], help="speculative methods in the batched engine: "
                   "auto picks each step's draft tree (plain decoding included) from the step's measured cost and "
                   "the requests' acceptance, for the most tokens per second; fixed always runs the configured tree "
                   "(default: fixed for generate and wherever --depth, --tree-top-k or --total-tokens is given, "
                   "else auto)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, the AR output exactly; above 0: "
                   "sample, with the output distributed as AR sampling's")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of most likely tokens "
                   "whose probability reaches TOP_P, in (0, 1]")
    p.add_argument("--top-k", dest="sample_top_k", metavar="TOP_K", type=int, default=0, help="sample from the "
                   "TOP_K most likely tokens (0: no limit)")
    p.add_argument("--seed", type=int, help="random seed of the sampling, for a repeatable output (default: a "
                   "fresh one per request)")


def sampling_from_args(a: argparse.Namespace) -> dict:
    """The LLM's sampling keywords, validated now: a bad value ends the command before the model loads."""
    from .speculative.sampling import SamplingParams

    p = SamplingParams(a.temperature, a.top_p, a.sample_top_k, a.seed)
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed}


def llm_from_args(a: argparse.Namespace, method: str | None = None):
    from .llm import LLM

    return LLM(a.engine, method=method or a.method, draft=a.draft, device=a.device, w_max=a.w_max,
               k_pre=a.k_pre, k_ver=a.k_ver, k_tree=a.k_tree, static_k=a.static_k, depth=a.depth, top_k=a.top_k,
               total_tokens=a.total_tokens, max_seq_len=a.max_seq_len, cuda_graphs=not a.eager, dtype=a.dtype,
               tp=a.tp, tp_timeout=a.tp_timeout, max_batch=getattr(a, "max_batch", None),
               kv_memory=getattr(a, "kv_memory", None), max_num_tokens=getattr(a, "max_num_tokens", None),
               spec_policy=getattr(a, "spec_policy", "auto"), overlap=getattr(a, "overlap", None),
               prefix_cache=getattr(a, "prefix_cache", True))


def resolve_tree(a: argparse.Namespace, device: str | None = None):
    """--depth / --tree-top-k / --total-tokens left unset take the tree of the device the command runs on
    (speculative.tree.tree_for, which LLM(...) uses too); returns that device."""
    from .engine.loader import pick_device
    from .speculative.tree import tree_for

    dev = pick_device(device or a.device)[0]
    t = tree_for(dev, a.depth, a.top_k, a.total_tokens)
    a.depth, a.top_k, a.total_tokens = t.depth, t.top_k, t.total_tokens
    return dev


def cmd_models(a) -> None:
    from .models import registry

    if a.action == "list":
        for m in MODELS.values():
            cached = "cached" if registry.gguf_path(m.key).exists() else "-"
            print(f"{m.key:22s} {m.size / 2**20:7.0f} MiB  {cached:6s}  {m.description}")
    else:
        if not a.key:
            raise UserError(f"which model? valid keys: {', '.join(MODELS)}")
        print(registry.fetch(a.key))


def cmd_build(a) -> None:
    from .models.build import build_engine
    from .models.registry import cache_dir

    out = a.out or (cache_dir() / "engines" / a.source if a.source in MODELS else None)
    if out is None:
        raise UserError("--out DIR is required when building from a file or directory")
    if (Path(out) / "config.json").exists() and not a.force:  # a finished build (config.json is written last)
        print(f"{out} is already built; --force rebuilds it", file=sys.stderr)
        print(out)
        return
    build_engine(a.source, out, dtype=a.dtype, max_seq_len=a.max_seq_len)
    print(out)


def cmd_build_draft(a) -> None:
    from .llm import resolve_engine
    from .speculative.eagle import build_draft

    out, what = build_draft(a.checkpoint, resolve_engine(a.engine), a.out)
    print(f"loaded {what} -> {out}")


JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", type(None): "null", list: "an array",
              dict: "an object"}


def read_prompts(path: str) -> list[str]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read the prompts file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}): give prompts one per line, or a JSON list of "
                        "strings") from None
    try:  # a line of only spaces is a blank line, not a prompt
        prompts = json.loads(text) if text.lstrip().startswith("[") else [ln for ln in text.splitlines() if ln.strip()]
    except ValueError as e:
        raise UserError(f"{path} is not a JSON list of prompts: {e}") from None
    if not prompts:
        raise UserError(f"{path} holds no prompts (one per line, or a JSON list of strings)")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            what = "an empty string" if p == "" else f"{JSON_TYPES[type(p)]} {json.dumps(p)[:40]}"
            raise UserError(f"{path}: prompt {i} (counting from 0) is {what}, not a non-empty string")
    return prompts


def cmd_generate(a) -> None:
    from . import parallel

    sampling = sampling_from_args(a)
    llm = llm_from_args(a)
    prompts = read_prompts(a.prompts_file) if a.prompts_file else None
    if parallel.rank() > 0:  # the other ranks run the same steps and print nothing
        llm.generate(prompts or a.prompt, a.max_new_tokens, chat=a.chat, **sampling)
        return
    if prompts:  # one batch: every prompt decoded together, one JSON line or text block per prompt
        results = llm.generate(prompts, a.max_new_tokens, chat=a.chat, **sampling)
        for r in results:
            print(json.dumps(r.to_dict()) if a.json else f"{r.text}\n[{r.num_new_tokens} tokens, "
                  f"{r.stats['wall_s']:.2f} s]\n")
        plain_note([r.stats for r in results])
        return
    if a.json:
        r = llm.generate(a.prompt, a.max_new_tokens, chat=a.chat, **sampling)
        print(json.dumps(r.to_dict()))
        plain_note([r.stats])
        return
    gen = llm.stream_tokens(a.prompt, a.max_new_tokens, chat=a.chat, **sampling)
    try:
        while True:
            piece, _ = next(gen)
            print(piece, end="", flush=True)
    except StopIteration as stop:
        s = stop.value.stats
    print()
    extra = (f", acceptance {s['acceptance_length']:.2f}, vocab {s['vocab_mean']:.0f}"
             if s["rounds"] and a.method != "ar" else "")
    print(f"[{s['new_tokens']} tokens in {s['wall_s']:.2f} s, {s['tokens_per_s']:.1f} tok/s{extra}]", file=sys.stderr)
    plain_note([s])


PLAIN_WHY = {"cost": "a round of the draft tree costs more here than the tokens it is expected to return (the "
                     "calibrated step costs)",
             "acceptance": "the draft's acceptance on this text is too low for a round to pay"}


def plain_note(stats: list[dict]) -> None:
    """One line on stderr when the speculation policy ran every decoding step plain (no round at all): a user who
    asked for speculation learns it decoded as AR and why, instead of reading a missing acceptance as a broken head."""
    reasons: dict = {}
    for s in stats:
        if s["rounds"]:
            return
        for why, n in s["plain_reasons"].items():
            reasons[why] = reasons.get(why, 0) + n
    if reasons:
        why = max(reasons, key=reasons.get)
        print(f"microspec: decoded plainly, no speculative round ({sum(reasons.values())} plain steps): "
              f"{PLAIN_WHY.get(why, why)}; --spec-policy fixed runs every step as a round", file=sys.stderr)


def cmd_quickstart(a) -> None:
    """The main job: fetch and build the default model, then AR and MicroSpec on one chat prompt."""
    dev = resolve_tree(a)
    print(f"== tree: depth {a.depth}, tree-top-k {a.top_k}, {a.total_tokens} tokens (unset knobs: the "
          f"{'CPU' if dev.type == 'cpu' else 'GPU'}'s tree)")
    prompt = a.prompt
    results = {}
    # every step a round: the quickstart shows what a round accepts (auto may decode plainly where a round costs more
    # than it returns, as on most CPUs)
    a.spec_policy = "fixed"
    for method in ("ar", "microspec"):
        a.method = method
        r = llm_from_args(a).generate(prompt, a.max_new_tokens, chat=True)
        results[method] = r
        s = r.stats
        print(f"== {method}: {s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s"
              + (f", acceptance length {s['acceptance_length']:.2f}, mean draft vocabulary {s['vocab_mean']:.0f}, "
                 f"coverage {s['coverage']:.2f}" if method != "ar" else ""))
    print(results["microspec"].text)
    same = results["ar"].token_ids == results["microspec"].token_ids
    print(f"== MicroSpec output identical to AR greedy: {same}; speedup "
          f"{results['microspec'].stats['tokens_per_s'] / results['ar'].stats['tokens_per_s']:.2f}x")
    if not same:
        sys.exit(1)


DESCRIPTION = """\
LLM inference with EAGLE-2 speculative decoding and MicroSpec's tiny dynamic draft vocabulary: greedy output is
exactly the model's own greedy output, sampled output follows the model's own distribution, and both take fewer
target passes.

start here:   microspec quickstart          (fetch SmolLM2-135M, build it, compare AR and MicroSpec)
generate:     microspec generate --prompt "Why is the sky blue?" --chat --method microspec
serve:        microspec serve               (Triton Inference Server: gRPC streaming and HTTP generate)
`microspec COMMAND --help` explains each command; bad input ends with one line `microspec: error: ...`, exit 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless it names it already; options whose default is unset
    (None) or off (a flag) say nothing. Descriptions keep their own line breaks."""

    def _format_action(self, action):
        d, text = action.default, action.help or ""
        if (action.option_strings and not (d is None or d is False or d is argparse.SUPPRESS)
                and action.help is not argparse.SUPPRESS and "default" not in text):
            shown = ((",".join(map(str, d)) or "none") if isinstance(d, list) else str(d)).replace("%", "%%")
            action = copy.copy(action)  # read at --help time: set_defaults may have changed the default
            action.help = f"{text} (default: {shown})" if text else f"default: {shown}"
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """Bad arguments get one line, like every other error of the command (argparse prints its usage too).
    Sub-commands' parsers are Parsers too, so every --help shows the defaults (HelpFormatter)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        self.exit(2, f"microspec: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        a, rest = super().parse_known_args(args, namespace)
        if getattr(a, "spec_policy", "") is None and hasattr(a, "command"):  # the top parser: the whole command
            a.spec_policy = default_policy(a)
        return a, rest


def default_policy(a: argparse.Namespace) -> str:
    """--spec-policy left unset: `fixed` where the user named a tree (--depth, --tree-top-k, --total-tokens) or, in
    generate, a speculative method: what they asked for runs, every step a round of that tree (auto may decode
    plainly throughout, as on most CPUs, where a round costs more than it returns); else `auto` (serve and bench,
    whose load the policy follows). Decided at parsing, before resolve_tree fills the unset tree knobs in."""
    named_tree = any(getattr(a, k, None) is not None for k in ("depth", "top_k", "total_tokens"))
    return "fixed" if named_tree or (a.command == "generate" and a.method != "ar") else "auto"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="microspec", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="list or fetch the real models")
    m.add_argument("action", choices=["list", "fetch"])
    m.add_argument("key", nargs="?")
    m.set_defaults(func=cmd_models)

    b = sub.add_parser("build", help="GGUF file, model key or HF checkpoint dir -> engine dir")
    b.add_argument("source")
    b.add_argument("--out", help="engine directory (default for a model key: the cache)")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.add_argument("--max-seq-len", type=int, help="the engine's maximum tokens per request, prompt and output "
                   "together (default: the model's, at most 8192)")
    b.add_argument("--force", action="store_true", help="rebuild an engine that is already there (e.g. a damaged one)")
    b.set_defaults(func=cmd_build)

    bd = sub.add_parser("build-draft", help="an EAGLE checkpoint (EAGLE-1/2; EAGLE-3 of SafeAILab, SpecForge, "
                        "speculators/vLLM) -> draft dir tied to an engine")
    bd.add_argument("--checkpoint", required=True)
    bd.add_argument("--engine", required=True)
    bd.add_argument("--out", required=True)
    bd.set_defaults(func=cmd_build_draft)

    g = sub.add_parser("generate", help="generation (AR or speculative), greedy or sampled")
    add_llm_args(g)
    add_sampling_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts-file", help="a file of prompts, one per line (or a JSON list of strings): decoded "
                     "together as one batch")
    add_batch_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (fewer when the model "
                   "ends its answer)")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, ids, stats")
    g.set_defaults(func=cmd_generate)

    q = sub.add_parser("quickstart", help="fetch + build the default model, run AR and MicroSpec, compare")
    add_llm_args(q)
    q.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.set_defaults(func=cmd_quickstart)

    for name in FEATURE_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)  # inside: the sub-commands' modules import torch (Ctrl-C there too)
        args.func(args)
    except UserError as e:
        print(f"microspec: error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:  # under TP, above all: a collective timed out or lost its peer (a rank died or hangs)
        from . import parallel
        from .engine.loader import one_line

        if parallel.world() == 1:
            raise
        print(f"microspec: error: rank {parallel.rank()} of {parallel.world()}: {one_line(e)}", file=sys.stderr)
        os._exit(1)  # not sys.exit: tearing the process group down would wait on the missing rank
    except KeyboardInterrupt:
        print("microspec: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
