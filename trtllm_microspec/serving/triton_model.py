"""The Triton Python-backend model: MicroSpec behind `text_input` -> streamed `text_output`.

Runs inside Triton's Python stub (`triton_repo/microspec/1/model.py` re-exports `TritonPythonModel`). The model is
decoupled: `execute` only validates requests (bad ones get an error response at once) and hands them to one engine
loop thread, the only thread that touches the model; a third one sends its responses (Responder). Every
request, greedy or sampled, of every method, joins the running batch of the batched engine (in-flight batching
over the paged KV pool, `LLM.scheduler()`; under --tp the followers run the same steps, serving/tp.py). Streaming
requests get one response per text piece, then a final one with the statistics; non-streaming ones get a single
response with the whole text and the statistics.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from .. import parallel
from ..engine.loader import one_line
from ..engine.scheduler import Request
from ..llm import LLM
from ..models.registry import UserError
from ..models.tokenizer import TextStream
from ..speculative.sampling import SamplingParams
from . import tp as tp_serving
from .client import MAX_STOP_WORDS
from .server import STOP_FILE_ENV

# SamplingParams field -> the optional request input that sets it (TensorRT-LLM's names); none given: greedy (and
# speculate: false, a request that decodes as AR's under a speculative method)
SAMPLING_INPUTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "random_seed",
                   "speculate": "speculate"}
# config.pbtxt parameters that are numbers (the rest are strings); left out or empty: the LLM's default
NUMBERS = {"w_max": int, "k_pre": int, "k_ver": int, "k_tree": int, "static_k": int, "depth": int, "top_k": int,
           "total_tokens": int, "max_seq_len": int, "max_batch": int, "max_num_tokens": int, "kv_memory": float,
           "tp": int, "tp_timeout": float, "tp_port": int}
# seconds between the engine's asks whether each running request's client went away: an ask is a round trip to
# tritonserver; asked for each request at every step, the asks held the engine thread ~3 ms a step at 64 requests
# (smollm2 on this repository's 2-core CPU), where a GPU step of 64 requests takes ~4-5 ms
CANCEL_CHECK_S = 0.05
# the batch's state on Triton's metrics port (gauges per model instance)
METRICS = {"microspec_running_requests": "requests decoding now (the batch)",
           "microspec_waiting_requests": "requests accepted and waiting for KV blocks or their turn (those in "
                                         "Triton's queue: nv_inference_pending_request_count)",
           "microspec_kv_blocks_used": "KV-cache blocks held by the batch's requests",
           "microspec_kv_blocks_total": "KV-cache blocks of the batch's pool (--kv-memory)",
           "microspec_tree_tokens": "draft-tree tokens per request of the batch's last decoding step, the speculation "
                                    "policy's choice (1: plain decoding; 0: none yet)"}
# where the serving threads' time goes (counters, seconds): whether a server is bound by its host work or the device
TIMES = {"microspec_step_seconds": "time the engine thread spent in the batched engine's steps",
         "microspec_between_steps_seconds": "time the engine thread spent between steps while requests ran (taking "
                                            "new ones, cancellation checks, detokenizing): no step is scheduled then",
         "microspec_response_seconds": "time the response thread spent making and sending responses"}
TIMES_EVERY_S = 1.0  # how often the counters are brought up to date (each update is a call into the stub)


@dataclass(eq=False)
class Job:
    sender: object  # the request's response sender: requests themselves may not outlive `execute`
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    end_id: int | None
    stop_words: list[str]
    sampling: SamplingParams
    text_of: TextStream  # the text of `ids`, decoded incrementally
    req: Request | None = None  # in the batched engine
    ids: list[int] = field(default_factory=list)  # generated so far
    text: str = ""  # the output so far (cut at a stop word or end_id); streamed: what was sent


def _input(request, name: str, required: bool = False):
    """An input's values (flat), or None when the request left an optional one out. Triton checks dtypes and shapes
    against config.pbtxt, but lets a request through that lacks a required input while it has optional ones."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        if required:
            raise UserError(f"the request has no {name} (a required input)")
        return None
    return t.as_numpy().reshape(-1)


def _decode(b: bytes, name: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not valid UTF-8: {e}") from None


def _held(text: str, word: str) -> int:
    """The length of the longest end of `text` that begins `word` (shorter than it). Only where `word`'s first
    character is are its prefixes compared: the cost is that of the text's tail, however long the word (a 300 KB
    stop word, compared prefix by prefix, held the engine loop and every request of the batch for 40 s)."""
    i = text.find(word[0], max(0, len(text) - len(word) + 1))
    while i >= 0:
        if word.startswith(text[i:]):
            return len(text) - i
        i = text.find(word[0], i + 1)
    return 0


def _numbers(p: dict[str, str]) -> dict[str, int | float]:
    """The numeric config.pbtxt parameters that are set."""
    out = {}
    for k, kind in NUMBERS.items():
        if p.get(k):
            try:
                out[k] = kind(p[k])
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise UserError(f"config.pbtxt parameter {k} must be {what}, got {p[k]!r}") from None
    return out


def _response(text: str, stats: dict | None = None):
    out = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
    if stats is not None:
        out += [pb_utils.Tensor("num_input_tokens", np.array([stats["prompt_tokens"]], np.int32)),
                pb_utils.Tensor("num_output_tokens", np.array([stats["new_tokens"]], np.int32)),
                pb_utils.Tensor("num_cached_tokens", np.array([stats["cached_tokens"]], np.int32)),  # prefix cache
                # NaN: no speculative round ran (the statistics' None; a tensor has no null)
                *(pb_utils.Tensor(name, np.array([np.nan if v is None else v], np.float32)) for name, v in
                  (("acceptance_length", stats["acceptance_length"]), ("mean_active_vocab", stats["vocab_mean"])))]
    return pb_utils.InferenceResponse(output_tensors=out)


def _error(message: str, code: str = "INVALID_ARG"):
    # pb_utils gets TritonError and the flags from the stub once the model runs, not at import
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


def _shutdown():
    return _error("the server is shutting down", "UNAVAILABLE")


def _send(sender, response=None, final: bool = False) -> None:
    try:
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
    except Exception:
        pass  # the client is gone: the loop's cancellation check ends its request


class Responder:
    """Sends the engine's responses from a thread of its own, in the order they were queued. A response is a round
    trip to tritonserver, once per streaming request per step: with 64 streaming requests (smollm2, AR, this
    repository's 2-core CPU, ~27 requests' tokens a step) the engine thread spent 10.7 ms a step sending them, at
    0.3-0.4 ms each, before it could schedule the next step; with this thread, 0.8 ms. On a GPU the sends then
    overlap the next step, during which the engine thread waits on the device without the GIL (not measured
    there yet). Triton's vLLM backend does the same (triton-inference-server/vllm_backend#46)."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = 0.0  # seconds spent making and sending responses (TIMES)
        self.thread = threading.Thread(target=self._run, name="microspec-responses", daemon=True)
        self.thread.start()

    def put(self, sender, response, final: bool = False) -> None:
        """response: an InferenceResponse, or a function that makes one (built on this thread, not the engine's)."""
        self.queue.put((sender, response, final))

    def close(self) -> None:
        """Sends what is queued, then ends the thread."""
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            t0 = time.perf_counter()
            sender, response, final = item
            try:
                response = response() if callable(response) else response
            except Exception as e:  # our own fault: the request still ends, with the error
                response, final = _error(f"internal error: {type(e).__name__}: {one_line(e)}", "INTERNAL"), True
            _send(sender, response, final)
            self.busy += time.perf_counter() - t0


class Gauges:
    """METRICS on Triton's metrics port (the Python backend's custom metrics), set when a value changes; and the
    TIMES counters, brought up to the running totals every TIMES_EVERY_S."""

    def __init__(self, labels: dict[str, str]):
        self.families = [pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.GAUGE)
                         for name, text in METRICS.items()]
        self.families += [pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
                          for name, text in TIMES.items()]
        self.metrics = [f.Metric(labels=labels) for f in self.families]
        self.values: tuple = ()
        self.counted = [0.0] * len(TIMES)  # what the counters hold
        self.next_count = 0.0  # (time.monotonic())

    def set(self, *values: int) -> None:
        if values != self.values:
            for m, v in zip(self.metrics, values):
                m.set(v)
            self.values = values

    def count(self, *totals: float) -> None:
        """The TIMES counters to these running totals (seconds), at most every TIMES_EVERY_S."""
        if time.monotonic() < self.next_count:
            return
        self.next_count = time.monotonic() + TIMES_EVERY_S
        for i, (m, total) in enumerate(zip(self.metrics[len(METRICS):], totals)):
            if total > self.counted[i]:
                m.increment(total - self.counted[i])
                self.counted[i] = total

    def close(self) -> None:
        self.metrics.clear()  # a metric must go before its family
        self.families.clear()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        device = p.get("device") or None
        if args["model_instance_kind"] == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        knobs = _numbers(p)  # LLM checks their ranges
        tp_port = knobs.pop("tp_port", None)
        kwargs = dict(engine=p["engine_dir"], method=p.get("method", "ar"), draft=p.get("draft_dir") or None,
                      device=device, dtype=p.get("dtype") or None, cuda_graphs=p.get("cuda_graphs") != "false",
                      spec_policy=p.get("spec_policy") or "auto",
                      overlap=None if not p.get("overlap") else p["overlap"] != "false",
                      prefix_cache=p.get("prefix_cache") != "false", **knobs)
        self.tp = knobs.get("tp", 1)
        if self.tp > 1:  # rank 0 of `microspec serve --tp`: its followers run every step with it (serving/tp.py)
            if tp_port is None:
                raise UserError("tp > 1 needs the tp_port of the group's store: start it with `microspec serve --tp`")
            kwargs.setdefault("tp_timeout", parallel.DEFAULT_TIMEOUT_S)
            tp_serving.join(self.tp, 0, tp_port, device, kwargs["tp_timeout"])
            self.llm = tp_serving.lead(LLM, kwargs)
        else:
            self.llm = LLM(**kwargs)
        self.sched = self.llm.scheduler()  # every request joins the batched engine (--tp: its steps sent, tp.py)
        # one short generation before the model reports ready, through the path requests take: kernel
        # loading and the first CUDA-graph captures are paid here, not by the first client (on the H200 its first
        # token took 0.79 s without this); a sampled request's graphs are captured when it first comes
        self.llm.generate(["Hello"], 16)
        self.capacity = self.llm.max_batch  # requests the engine runs at once
        # a prompt of at most max_prompt tokens is at most this many bytes: a longer text_input is refused before it
        # is decoded or tokenised (a 5 MB body otherwise held execute, and every request behind it, for seconds)
        self.max_prompt_bytes = self.llm.max_prompt * self.llm.tokenizer.max_token_bytes()
        self.vocab_size = self.llm.target.cfg.vocab_size
        self.inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # execute -> the engine loop
        self.load = 0  # requests accepted and not ended yet
        self.cond = threading.Condition()  # guards `load`; notified when a request ends
        self.batch: dict[Request, Job] = {}  # the batched engine's requests (running or waiting for blocks)
        # Triton calls finalize only once no request is in flight, so `microspec serve` announces a shutdown with
        # this file: running and queued requests then end at once with an error instead of holding the server up
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self.stopping = False
        # `execute` returns only while this instance's engine has room for one more running request (max_batch; one
        # on the single-request path): a full engine holds Triton's next request back, in Triton's queue, which
        # refuses requests beyond its max_queue_size as UNAVAILABLE (HTTP 503, retryable) and, with several
        # instances (serve --gpus 0,1), hands each request to an engine with room rather than to a full one.
        self.responses = Responder()  # every response of a request in the engine goes through it, in order
        self.next_cancel_check = 0.0  # (time.monotonic())
        self.step_s = self.between_s = 0.0  # the engine thread's time in steps and between them (TIMES)
        self.gauges = Gauges({"model": args["model_name"], "instance": args["model_instance_name"]})
        self._report()
        self.loop = threading.Thread(target=self._engine, name="microspec-engine", daemon=True)
        self.loop.start()

    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._parse(request, sender)
            except UserError as e:
                _send(sender, _error(str(e)), final=True)
                continue
            except Exception as e:  # our own fault: the class and the message, no traceback or server paths
                _send(sender, _error(f"internal error reading the request: {type(e).__name__}: {one_line(e)}",
                                     "INTERNAL"), final=True)
                continue
            if self._stopping():
                _send(sender, _shutdown(), final=True)
                continue
            with self.cond:
                self.load += 1
            self.inbox.put(job)
            with self.cond:
                self.cond.wait_for(lambda: self.load < self.capacity or self._stopping())

    def finalize(self) -> None:
        self.stopping = True
        self.inbox.put(None)
        self.loop.join(timeout=30)
        self.responses.close()  # the loop's last responses (shutdown errors) go out first
        self.gauges.close()
        if self.tp > 1:
            tp_serving.stop()

    def _stopping(self) -> bool:
        return self.stopping or bool(self.stop_file and os.path.exists(self.stop_file))

    def _parse(self, request, sender) -> Job:
        text, max_tokens = _input(request, "text_input", True)[0], int(_input(request, "max_tokens", True)[0])
        if len(text) > self.max_prompt_bytes:
            raise UserError(f"text_input is {len(text)} bytes: this engine holds at most {self.llm.max_prompt}"
                            f" prompt tokens, at most {self.max_prompt_bytes} bytes")
        prompt = _decode(text, "text_input")
        if not prompt:
            raise UserError("text_input is empty")
        if not 0 < max_tokens <= self.llm.max_seq_len:
            raise UserError(f"max_tokens must be between 1 and {self.llm.max_seq_len} (this engine's maximum "
                            f"sequence length), got {max_tokens}")
        stream, chat, end_id, stop = (_input(request, n) for n in ("stream", "chat", "end_id", "stop_words"))
        if end_id is not None and not 0 <= int(end_id[0]) < self.vocab_size:
            raise UserError(f"end_id must be a token id between 0 and {self.vocab_size - 1}, got {int(end_id[0])}")
        if stop is not None and len(stop) > MAX_STOP_WORDS:
            raise UserError(f"stop_words: at most {MAX_STOP_WORDS} stop words per request, got {len(stop)}")
        ids = self.llm.prompt_ids(prompt, bool(chat[0]) if chat is not None else False)
        self.llm.check(ids, max_tokens)  # UserError for a prompt too long for the engine
        given = {k: _input(request, name) for k, name in SAMPLING_INPUTS.items()}
        sampling = SamplingParams(**{k: v[0].item() for k, v in given.items() if v is not None})  # UserError if bad
        return Job(sender=sender, prompt_ids=ids, max_tokens=max_tokens, text_of=TextStream(self.llm.tokenizer),
                   stream=bool(stream[0]) if stream is not None else False,
                   end_id=int(end_id[0]) if end_id is not None else None,
                   stop_words=[w for w in (_decode(b, "stop_words") for b in stop) if w] if stop is not None else [],
                   sampling=sampling)

    def _engine(self) -> None:
        """The engine thread. An error that escapes the loop (a fault of ours: each request's and each step's own
        errors are handled inside it) ends the model's process: without its engine the model would stay ready
        while every stream hung. `microspec serve` sees the process die, fails what was in flight and restarts
        tritonserver (Triton alone restarts a dead stub)."""
        try:
            self._loop()
        except BaseException as e:
            print(f"microspec model: the engine loop failed ({type(e).__name__}: {one_line(e)}); ending the model's "
                  f"process", file=sys.stderr, flush=True)
            os._exit(1)

    def _loop(self) -> None:
        """The engine loop: the only thread that runs the model. Each turn takes the new requests, ends the
        cancelled ones and runs one step of the batch."""
        if self.llm.device.index is not None:  # the current GPU is per thread (serve --gpus 0,1: the one on GPU 1)
            torch.cuda.set_device(self.llm.device)
        t_end = None  # when the last step ended (None: the engine was idle since)
        while self._take():
            stopping, now = self._stopping(), time.monotonic()
            if stopping or now >= self.next_cancel_check:
                self.next_cancel_check = now + CANCEL_CHECK_S
                for job in list(self.batch.values()):
                    if stopping or job.sender.is_cancelled():  # shut down, or the client cancelled or went away
                        self._end(job, _shutdown() if stopping else _error("the request was cancelled", "CANCELLED"))
            if not self.sched.idle:  # also after a cancel: its blocks go back at this boundary
                t0 = time.perf_counter()
                if t_end is not None:
                    self.between_s += t0 - t_end
                self._step_batch()
                t_end = time.perf_counter()
                self.step_s += t_end - t0
            else:
                t_end = None  # (the wait for the next request is no host work)
            self._report()
        for job in list(self.batch.values()):
            self._end(job, _shutdown())

    def _take(self) -> bool:
        """Hands the requests `execute` queued to the engine, waiting for one while the engine is idle. False once
        finalize says stop."""
        jobs = [self.inbox.get()] if self.sched.idle else []
        while not self.inbox.empty():
            jobs.append(self.inbox.get())
        for job in jobs:
            if job is None:
                return False
            try:
                job.req = self.sched.add(job.prompt_ids, job.max_tokens, job.sampling)
            except UserError as e:  # it could never fit: over the sequence limit or the whole pool, or sampling
                self._end(job, _error(str(e)))  # under --tp
                continue
            self.batch[job.req] = job
        return True

    def _step_batch(self) -> None:
        try:
            emitted = self.sched.step()
        except Exception as e:  # the step of the whole batch failed: its requests end with the error
            emitted = []
            for req in self.sched.running:
                req.error = req.error or f"{type(e).__name__}: {e}"
        for req, toks in emitted:
            job = self.batch[req]
            if self._feed(job, toks, req.done):
                self._end(job, _response("" if job.stream else job.text, req.stats.summary()))
        for job in [j for j in self.batch.values() if j.req.error]:  # failed ones (the scheduler says so)
            self._end(job, _error(f"generation failed: {one_line(job.req.error)}", "INTERNAL"))

    def _feed(self, job: Job, toks: list[int], final: bool) -> bool:
        """A request's new tokens (final: its generation is over): stream the text they complete, and end the output
        at its end_id or first stop word (neither is part of it). True when the request is over."""
        job.ids += toks
        end = job.end_id in toks  # (an end_id of earlier tokens ended the request then)
        if not (final or end or job.stream or job.stop_words):
            return False  # nothing to send or search yet: decoded once, at the end
        text = job.text_of(job.ids[:job.ids.index(job.end_id)] if end else job.ids, final or end)
        if text is None:
            return False  # an incomplete UTF-8 sequence: wait for the tokens that complete it
        cut = min((i for i in (text.find(w) for w in job.stop_words) if i >= 0), default=len(text))
        over = final or end or cut < len(text)
        # streamed: a tail that may begin a stop word waits for the next tokens (else a stop word split over two
        # pieces would be half sent)
        hold = 0 if over else max((_held(text, w) for w in job.stop_words), default=0)
        piece, job.text = text[len(job.text):cut - hold], text[:cut - hold]
        if job.stream and piece:
            self.responses.put(job.sender, lambda: _response(piece))
        return over

    def _end(self, job: Job, response) -> None:
        """A request's final response. The engine lets it go: its blocks go back at the next boundary."""
        if job.req is not None:
            self.sched.cancel(job.req)  # nothing left to do for one that finished
            del self.batch[job.req]
        with self.cond:  # first: execute then takes Triton's next request before this client can send another
            self.load -= 1
            self.cond.notify_all()
        self.responses.put(job.sender, response, final=True)

    def _report(self) -> None:
        s = self.sched
        tree = next((r.tree for r in reversed(s.history) if r.tree), 0)  # the last decoding step's
        self.gauges.set(len(s.running), len(s.waiting), s.blocks.used, s.blocks.num_blocks - 1, tree)
        self.gauges.count(self.step_s, self.between_s, self.responses.busy)

