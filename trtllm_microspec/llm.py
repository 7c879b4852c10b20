"""The Python API: `LLM(engine, method=...)` with `generate` and `stream`.

    from trtllm_microspec import LLM
    llm = LLM("smollm2-135m", method="microspec")        # a model key (built on first use) or an engine dir
    print(llm.generate("What is 2+2?", chat=True).text)
    for piece in llm.stream("Tell me a story", chat=True, max_new_tokens=64):
        print(piece, end="", flush=True)
    llm.generate("Tell me a story", temperature=0.7, top_p=0.9, top_k=50, seed=1)   # sampling (SamplingParams)

`top_k` of `LLM(...)` is the EAGLE-2 tree's branching; `top_k` of generate/stream is the sampling filter.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from . import parallel
from .engine.loader import load_target, one_line, pick_device, read_config
from .engine.policy import POLICIES, tree_shapes
from .engine.runner import check_request, round_reserve
from .models.registry import MODELS, UserError, cache_dir, need
from .models.tokenizer import TextStream
from .speculative.sampling import SamplingParams
from .speculative.tree import tree_for
from .vocab.frequency import FREQ_FILE
from .vocab.strategies import METHODS, make_vocab

DRAFT_SUBDIR = "eagle"  # an engine's default draft head lives in <engine>/eagle
# microspec's k_tree when none is given (issue 37, benchmarks/cpu_fill_smollm2.md); the other windows take 0, so that
# microspec-paper and the ablations stay the paper's window
DEFAULT_K_TREE = 3


def k_tree_for(method: str, k_tree: int | None) -> int:
    """The k_tree a method runs with: the one given, else DEFAULT_K_TREE for microspec and 0 for the rest."""
    if k_tree is not None:
        return k_tree
    return DEFAULT_K_TREE if method == "microspec" else 0


def resolve_engine(engine: str | Path) -> Path:
    """An engine directory, or a model key: its engine in the cache, built on first use."""
    p = Path(engine)
    if p.exists():
        return p
    if str(engine) in MODELS:
        out = cache_dir() / "engines" / str(engine)
        if not (out / "config.json").exists():
            from .models.build import build_engine
            build_engine(str(engine), out)
        return out
    raise UserError(f"engine {engine} not found: give an engine directory or a model key ({', '.join(MODELS)})")


def check_knobs(vocab_size: int, w_max: int = 3072, k_pre: int = 3, k_ver: int = 3, static_k: int = 32768,
                depth: int = 5, top_k: int = 10, total_tokens: int = 60, max_seq_len: int | None = None,
                tp: int = 1, tp_timeout: float = parallel.DEFAULT_TIMEOUT_S, max_batch: int | None = None,
                kv_memory: float | None = None, max_num_tokens: int | None = None, k_tree: int = 3) -> None:
    """Refuse knobs the engine cannot run, in one line, before they fail deep inside a kernel (a window of 0 ids
    divides by zero, a top-k over fewer candidates than k is out of range, a negative length is a negative size)."""
    vocab = f"the vocabulary has {vocab_size} ids"
    need("the tree's top_k", top_k, 1, vocab_size, vocab)
    need("depth", depth, 1)
    pool = top_k + depth * top_k * top_k  # the draft tokens an EAGLE-2 tree of this top_k and depth chooses from
    need("total_tokens", total_tokens, 2, pool + 1, f"the root plus up to {pool} draft tokens at the tree's top_k "
         f"{top_k}, depth {depth}")
    need("w_max", w_max, top_k, vocab_size, f"the window holds at least the tree's top_k ids; {vocab}")
    need("static_k", static_k, top_k, vocab_size, f"at least the tree's top_k ids; {vocab}")
    need("k_pre", k_pre, 0, vocab_size, f"0: the window starts from the prompt's own tokens; {vocab}")
    need("k_ver", k_ver, 0, vocab_size, f"0: rounds add only the draft tree's tokens; {vocab}")
    need("k_tree", k_tree, 0, vocab_size, f"0: none from the tree's other nodes; {vocab}")
    if max_seq_len is not None:
        need("max_seq_len", max_seq_len, 1)
    need("tp", tp, 1)
    if not 0 < tp_timeout < math.inf:  # NaN fails this too
        raise UserError(f"tp_timeout must be positive (seconds), got {tp_timeout}")
    if max_batch is not None:
        need("max_batch", max_batch, 1)
    if max_num_tokens is not None:
        need("max_num_tokens", max_num_tokens, 1)
        if max_batch is not None:  # every running request decodes at least one row a step (a tree: more, runner)
            need("max_num_tokens", max_num_tokens, max_batch, why=f"every one of max_batch {max_batch} requests "
                 "decodes a row each step")
    if kv_memory is not None and not 0 < kv_memory < math.inf:
        raise UserError(f"kv_memory must be positive (a fraction of free GPU memory, or GiB), got {kv_memory}")


def is_prompt_list(prompt) -> bool:
    """A list of prompts (each a string or a chat), not one chat (a list of message dicts)."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], dict)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    num_new_tokens: int
    stats: dict
    # (time.perf_counter(), tokens) of each step that emitted any of its tokens (the batched engine, vLLM's engine
    # loop): what `microspec bench --concurrency` times from the request's submission (engine/stats.py load_times)
    emits: list[tuple[float, int]] | None = None

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "num_new_tokens": self.num_new_tokens,
                "wall_s": self.stats["wall_s"], "tokens_per_s": self.stats["tokens_per_s"], "stats": self.stats}


class LLM:
    def __init__(self, engine: str | Path, method: str = "ar", draft: str | Path | None = None,
                 device: str | None = None, w_max: int = 3072, k_pre: int = 3, k_ver: int = 3,
                 static_k: int = 32768, depth: int | None = None, top_k: int | None = None,
                 total_tokens: int | None = None, max_seq_len: int | None = None, cuda_graphs: bool = True,
                 dtype: str | None = None, tp: int = 1, tp_timeout: float = parallel.DEFAULT_TIMEOUT_S,
                 max_batch: int | None = None, kv_memory: float | None = None, max_num_tokens: int | None = None,
                 spec_policy: str = "auto", overlap: bool | None = None, k_tree: int | None = None,
                 prefix_cache: bool = True):
        """depth / top_k / total_tokens left None: the device's tree (speculative.tree.tree_for: depth 3, top-k 4,
        12 tokens on a CPU; depth 5, top-k 10, 60 tokens on a GPU). max_batch: most requests decoded together
        (None: 256 on CUDA, 16 on the CPU); max_num_tokens: the batched engine's tokens of target work per step,
        prompt chunks and plain decode rows together, a tree's rows taking from the prompts' share (None: 8192 on
        CUDA, 1024 on the CPU, at least max_batch; the same for every method). spec_policy: auto (the batched engine
        picks each step's tree, plain decoding included, from the step's measured cost and the requests'
        acceptance: engine/policy.py) or fixed (always
        the configured tree). overlap: the batched engine schedules and launches an AR step (a speculative method's
        plain step) while the one before runs on the GPU, reading its tokens one step late (engine/scheduler.py;
        None: DEFAULT_OVERLAP, on).
        k_tree: a MicroSpec window also takes the target's top-k_tree ids at every verified tree node, the rejected
        ones too (None: k_tree_for's default, 3 for microspec, 0 for the paper's window and the ablations).
        prefix_cache: the batched engine keeps the KV blocks of requests that ended and gives a new request the
        ones that start its prompt, prefilling only the rest (engine/block_manager.py): AR's requests, and a
        speculative method's that decode as AR's; one that speculates prefills its whole prompt (its window and
        draft state start from every row of it)."""
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        self.engine_dir = resolve_engine(engine)
        k_tree = k_tree_for(method, k_tree)
        self.device, dtype = pick_device(device, dtype)
        tree = tree_for(self.device, depth, top_k, total_tokens)
        check_knobs(read_config(self.engine_dir).vocab_size, w_max, k_pre, k_ver, static_k, tree.depth, tree.top_k,
                    tree.total_tokens, max_seq_len, tp, tp_timeout, max_batch, kv_memory, max_num_tokens, k_tree)
        self.method = method
        if spec_policy not in POLICIES:
            raise UserError(f"unknown spec_policy {spec_policy!r}; choose one of {', '.join(POLICIES)}")
        self.spec_policy = spec_policy
        if tp > 1:  # every rank builds the same LLM and runs the same steps (parallel.py)
            self.device = parallel.init(tp, self.device, tp_timeout)
        if self.device.index is not None:  # Triton kernels launch on the thread's current GPU, not the tensors' one
            torch.cuda.set_device(self.device)
        self.target, self.tokenizer = load_target(self.engine_dir, self.device, dtype, max_seq_len,
                                                  draft_head=method != "ar")
        draft_model = vocab = None
        if method != "ar":
            from .speculative.eagle import load_draft
            draft_dir = Path(draft) if draft else self.engine_dir / DRAFT_SUBDIR
            if not draft_dir.exists():
                raise UserError(f"method {method} needs a draft head: pass --draft DIR (none at {draft_dir})")
            try:
                draft_model = load_draft(draft_dir, self.target, dtype, self.device)
            except UserError:
                raise
            except Exception as e:  # its files cut short or of another shape
                raise UserError(f"draft {draft_dir} is damaged ({one_line(e)}): rebuild or retrain it") from None
            head, head_ids = draft_model.vocab_rows()  # EAGLE-3: its own LM head and the target id of each row
            # frspec over an EAGLE-3 head is its own draft vocabulary: no ranking needed
            ranks = method != "eagle" and not (method == "frspec" and head_ids is not None)
            ranked = self._ranked_ids(draft_dir) if ranks else None
            vocab = make_vocab(method, head, self.target.cfg.eos_ids, w_max=w_max, ranked_ids=ranked,
                               static_k=static_k, head_ids=head_ids, vocab_size=self.target.cfg.vocab_size)
        self.draft, self.vocab, self.tree, self.k_pre, self.k_ver = draft_model, vocab, tree, k_pre, k_ver
        self.k_tree = k_tree
        # cache slots a step may write past a request's committed length: AR one, else the largest tree the
        # speculation policy may pick
        self.reserve = 1 if draft_model is None else max(round_reserve(t) for t in tree_shapes(tree, spec_policy) if t)
        if self.max_prompt < 1:
            raise UserError(f"max_seq_len {self.max_seq_len} leaves no room for a prompt: each step reserves "
                            f"{self.reserve} cache slots (raise max_seq_len or shrink the tree)")
        self._lock = threading.Lock()  # one caller drives the engine at a time (serving has its own loop)
        from .engine.scheduler import DEFAULT_MAX_BATCH
        self.max_batch = max_batch or DEFAULT_MAX_BATCH[self.device.type]
        self.kv_memory, self.max_num_tokens = kv_memory, max_num_tokens
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.overlap, self.prefix_cache = overlap, prefix_cache
        self._scheduler = None  # the batched engine and its KV pool, made on first use

    def _ranked_ids(self, draft_dir: Path) -> torch.Tensor | None:
        """FR-Spec's ranking (frspec's vocabulary, microspec's fill): the engine's (build-freq), else the draft
        head's (train-draft's, of its training answers), None if neither has one."""
        f = next((f for f in (self.engine_dir / FREQ_FILE, draft_dir / FREQ_FILE) if f.exists()), None)
        if f is None:
            return None
        from safetensors.torch import load_file
        V = self.target.cfg.vocab_size
        try:
            ids = load_file(f)["ranked_ids"].long()
        except Exception as e:  # cut short, or not a ranking
            ids, why = None, one_line(e)
        else:  # distinct ids of the vocabulary (build-freq writes all of them); others are another engine's
            ok = ids.dim() == 1 and ids.numel() > 0 and 0 <= int(ids.min()) and int(ids.max()) < V \
                and ids.unique().numel() == ids.numel()
            why = None if ok else f"not a ranking of distinct ids of the engine's {V}"
        if why:
            raise UserError(f"{f} is damaged ({why}): rebuild it with `microspec build-freq --engine {self.engine_dir}`"
                            + ("" if f.parent == self.engine_dir else " or delete it"))
        return ids

    @property
    def max_seq_len(self) -> int:
        return self.target.cfg.max_seq_len

    @property
    def max_prompt(self) -> int:
        """The longest prompt a request may have: room for one step and its first token within max_seq_len."""
        return self.max_seq_len - self.reserve - 1

    def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """A UserError now for a request the engine could never run (the one rule of every path)."""
        check_request(prompt_ids, max_new_tokens, self.max_seq_len, self.target.cfg.vocab_size, self.reserve)

    def prompt_ids(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        return self.tokenizer.prompt_ids(prompt, chat)

    def stream_tokens(self, prompt: str | list[dict], max_new_tokens: int = 256, chat: bool = False,
                      incremental: bool = True, **sampling):
        """Yields (text piece, new token ids) per step; the generator's return value is the Result. The request
        runs in the batched engine as a batch of one. sampling: SamplingParams' fields (temperature, top_p,
        top_k, seed, speculate); none given: greedy. send(True) into the generator ends the request early
        (stop_reason "stopped"), its statistics kept."""
        params = SamplingParams(**sampling)
        ids = self.prompt_ids(prompt, chat)
        self.check(ids, max_new_tokens)
        sched = self.scheduler()
        with self._lock:
            req = sched.add(ids, max_new_tokens, params)
            out: list[int] = []
            pending: list[int] = []  # tokens whose text has not been yielded yet
            sent, text_of = "", TextStream(self.tokenizer)
            try:
                while not req.done:
                    for r, toks in sched.step():
                        if r is not req or not toks:
                            continue
                        out += toks
                        pending += toks
                        if not incremental:  # generate(): decode once at the end, not every step
                            continue
                        text = text_of(out)
                        if text is None:  # an incomplete UTF-8 sequence: wait for the rest
                            continue
                        piece, sent = text[len(sent):], text
                        if (yield piece, pending) and not req.done:  # the caller ends it now
                            sched.cancel(req)
                            sched.step()  # the boundary: it leaves, its blocks go back
                            req.stats.stop_reason = "stopped"
                        pending = []
            finally:
                if not req.done:  # the caller went away (GeneratorExit): the request leaves the engine
                    sched.cancel(req)
                    sched.step()
            text = self.tokenizer.decode(out)
            if text != sent or pending:
                yield text[len(sent):], pending
        return self.result(req)

    def step_costs(self, n: int) -> list[dict] | None:
        """The speculation policy's view of a batch of n requests (SpecPolicy.table at their rows bucket): each
        shape's tokens, prior tokens a round and estimated step seconds; None for AR, `fixed`, or before the engine."""
        runner = self._scheduler and self._scheduler.runner
        policy = getattr(runner, "policy", None)
        if policy is None or policy.policy == "fixed":
            return None
        from .engine.runner import batch_bucket
        return policy.table(batch_bucket(n, runner.max_batch))

    def graph_first_uses(self) -> int:
        """How many steps so far ran a CUDA-graph key's first use (its eager run or its capture) instead of a
        replay: a measurement meant for the steady state should see none (0 without graphs)."""
        graphs = self._scheduler and self._scheduler.runner.graphs
        return graphs.first_uses if graphs else 0

    def scheduler(self):
        """The batched engine (in-flight batching over a paged KV pool), made on first use."""
        if self._scheduler is None:
            from .engine.runner import BatchRunner
            from .engine.spec_runner import SpecRunner
            from .engine.scheduler import Scheduler
            if self.method == "ar":
                runner = BatchRunner(self.target, self.max_batch, self.kv_memory, self.cuda_graphs,
                                     max_num_tokens=self.max_num_tokens, prefix_cache=self.prefix_cache)
            else:
                runner = SpecRunner(self.target, self.draft, self.vocab, self.tree, self.k_pre, self.k_ver,
                                    self.max_batch, self.kv_memory, self.cuda_graphs, self.max_num_tokens,
                                    self.spec_policy, k_tree=self.k_tree, prefix_cache=self.prefix_cache)
                if self.cuda_graphs:  # the policy's step costs measured now, every graph it may pick captured
                    runner.calibrate()
            self._scheduler = Scheduler(runner, self.max_batch, self.overlap)
        return self._scheduler

    def result(self, req) -> Result:
        """A finished request of the batched engine as a Result."""
        if req.error:
            raise RuntimeError(f"generation failed: {req.error}")
        return Result(text=self.tokenizer.decode(req.out), token_ids=list(req.out), num_new_tokens=len(req.out),
                      stats={"method": self.method, **req.stats.summary(),
                             "ttft_s": req.t_first - req.t_submit if req.t_first else None,
                             "inter_token_s": req.inter_token_s}, emits=list(req.emits))

    def generate(self, prompt: str | list[dict] | list[str | list[dict]], max_new_tokens: int | list[int] = 256,
                 chat: bool = False, **sampling) -> Result | list[Result]:
        """One prompt -> its Result; a list of prompts -> their Results, decoded together as one batch
        (in-flight batching: at most max_batch at once, the rest join as others finish), each with the tokens it
        gets alone. sampling: SamplingParams' fields, for every prompt; none given: greedy (speculate=False: the
        requests decode as AR's under a speculative method, with the same tokens)."""
        if is_prompt_list(prompt):
            budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompt)
            if len(budgets) != len(prompt):
                raise UserError(f"{len(prompt)} prompts but {len(budgets)} max_new_tokens")
            params = SamplingParams(**sampling)  # each request draws from its own generator seeded with params.seed
            sched = self.scheduler()
            with self._lock:
                reqs = [sched.add(ids, m, params) for ids, m in zip(self.tokenizer.prompts_ids(prompt, chat), budgets)]
                sched.run(reqs)
            return [self.result(r) for r in reqs]
        gen = self.stream_tokens(prompt, max_new_tokens, chat, incremental=False, **sampling)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value

    def stream(self, prompt: str | list[dict], max_new_tokens: int = 256, chat: bool = False,
               **sampling) -> Iterator[str]:
        for piece, _ in self.stream_tokens(prompt, max_new_tokens, chat, **sampling):
            if piece:
                yield piece
