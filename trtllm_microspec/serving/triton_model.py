"""The Triton Python-backend model: MicroSpec behind `text_input` -> streamed `text_output`.

Runs inside Triton's Python stub (`triton_repo/microspec/1/model.py` re-exports `TritonPythonModel`). The model is
decoupled: `execute` only validates requests (bad ones get an error response at once) and queues them; one worker
thread runs them in order, because the LLM holds static KV caches and serves one request at a time. Streaming
requests get one response per text piece, then a final one with the statistics; non-streaming ones get a single
response with the whole text and the statistics.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import parallel
from ..llm import LLM
from ..models.registry import UserError
from ..spec.sampling import SamplingParams
from . import tp as tp_serving
from .server import STOP_FILE_ENV, check_queue_size

# SamplingParams field -> the optional request input that sets it (TensorRT-LLM's names); none given: greedy
SAMPLING_INPUTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "random_seed"}


@dataclass
class Job:
    sender: object  # the request's response sender: requests themselves may not outlive `execute`
    prompt: str
    max_tokens: int
    stream: bool
    chat: bool
    end_id: int | None
    stop_words: list[str]
    prompt_tokens: int
    sampling: dict  # LLM.generate's sampling keywords


class Shutdown(Exception):
    pass


class Cancelled(Exception):
    pass


def _input(request, name: str):
    """The single value of an optional input, or None when the request left it out."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    return t.as_numpy().reshape(-1)


def _decode(b: bytes, name: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not valid UTF-8: {e}") from None


def _int_params(p: dict[str, str], names: tuple[str, ...]) -> dict[str, int]:
    """The config.pbtxt parameters `names` as integers; left out or empty ones are left to the defaults."""
    out = {}
    for k in names:
        if p.get(k):
            try:
                out[k] = int(p[k])
            except ValueError:
                raise UserError(f"config.pbtxt parameter {k} must be an integer, got {p[k]!r}") from None
    return out


def _response(text: str, stats: dict | None = None):
    out = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
    if stats is not None:
        out += [pb_utils.Tensor("num_input_tokens", np.array([stats["prompt_tokens"]], np.int32)),
                pb_utils.Tensor("num_output_tokens", np.array([stats["new_tokens"]], np.int32)),
                pb_utils.Tensor("acceptance_length", np.array([stats["acceptance_length"]], np.float32)),
                pb_utils.Tensor("mean_active_vocab", np.array([stats["vocab_mean"]], np.float32))]
    return pb_utils.InferenceResponse(output_tensors=out)


def _error(message: str, code: str = "INVALID_ARG"):
    # pb_utils gets TritonError and the flags from the stub once the model runs, not at import
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


def _send(sender, response=None, final: bool = False) -> None:
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        device = p.get("device") or None
        if args["model_instance_kind"] == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        ints = _int_params(p, ("w_max", "k_pre", "k_ver", "static_k", "depth", "top_k", "total_tokens", "max_seq_len",
                               "max_queue_size", "tp", "tp_port"))
        max_queue_size = ints.pop("max_queue_size", 64)
        check_queue_size(max_queue_size)  # LLM checks the others
        tp_port = ints.pop("tp_port", None)
        kwargs = dict(engine=p["engine_dir"], method=p.get("method", "ar"), draft=p.get("draft_dir") or None,
                      device=device, dtype=p.get("dtype") or None, cuda_graphs=p.get("cuda_graphs") != "false", **ints)
        self.tp = ints.get("tp", 1)
        if self.tp > 1:  # rank 0 of `microspec serve --tp`: its followers run every step with it (serving/tp.py)
            if tp_port is None:
                raise UserError("tp > 1 needs the tp_port of the group's store: start it with `microspec serve --tp`")
            kwargs["tp_timeout"] = float(p.get("tp_timeout") or parallel.DEFAULT_TIMEOUT_S)
            tp_serving.join(self.tp, 0, tp_port, device, kwargs["tp_timeout"])
            self.llm = tp_serving.lead(LLM, kwargs)
        else:
            self.llm = LLM(**kwargs)
        # one short generation before the model reports ready: kernel loading and the CUDA-graph capture of the first
        # KV bucket are paid here, not by the first client (on the H200 its first token took 0.79 s without this)
        self.llm.generate("Hello", 16)
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue_size)
        # Triton calls finalize only once no request is in flight, so `microspec serve` announces a shutdown with
        # this file: running and queued requests then end at once with an error instead of holding the server up
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self.stopping = False
        # several instances (serve --gpus 0,1): Triton gives a request to any instance whose `execute` is free, and
        # ours returns at once, so a busy engine would keep taking requests while another idles; with several, each
        # `execute` returns only once its engine is done, and Triton's queue feeds whichever engine is free
        groups = config.get("instance_group", [])
        self.balance = sum(g.get("count", 1) * max(len(g.get("gpus") or []), 1) for g in groups) > 1
        self.worker = threading.Thread(target=self._work, name="microspec-worker", daemon=True)
        self.worker.start()

    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._parse(request, sender)
                if self._stopping():
                    raise Shutdown()
                self.jobs.put_nowait(job)
                if self.balance:
                    self.jobs.join()
            except UserError as e:
                _send(sender, _error(str(e)), final=True)
            except queue.Full:
                _send(sender, _error(f"the server is busy: {self.jobs.maxsize} requests are already queued",
                                     "UNAVAILABLE"), final=True)
            except Shutdown:
                _send(sender, _error("the server is shutting down", "UNAVAILABLE"), final=True)
        return None

    def finalize(self) -> None:
        self.stopping = True
        while True:  # queued requests will never run: tell their clients
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _send(job.sender, _error("the server is shutting down", "UNAVAILABLE"), final=True)
        self.jobs.put(None)
        self.worker.join(timeout=30)
        if self.tp > 1:
            tp_serving.stop()

    def _stopping(self) -> bool:
        return self.stopping or bool(self.stop_file and os.path.exists(self.stop_file))

    def _parse(self, request, sender) -> Job:
        # Triton itself rejects a missing text_input or max_tokens and wrong dtypes or shapes (config.pbtxt)
        prompt = _decode(_input(request, "text_input")[0], "text_input")
        if not prompt:
            raise UserError("text_input is empty")
        max_tokens = int(_input(request, "max_tokens")[0])
        if not 0 < max_tokens <= self.llm.max_seq_len:
            raise UserError(f"max_tokens must be between 1 and {self.llm.max_seq_len} (this engine's maximum "
                            f"sequence length), got {max_tokens}")
        stream, chat, end_id, stop = (_input(request, n) for n in ("stream", "chat", "end_id", "stop_words"))
        chat = bool(chat[0]) if chat is not None else False
        ids = self.llm.prompt_ids(prompt, chat)
        self.llm.executor.check(ids, max_tokens)  # UserError for a prompt too long for the engine
        given = {k: _input(request, name) for k, name in SAMPLING_INPUTS.items()}
        sampling = SamplingParams(**{k: v[0].item() for k, v in given.items() if v is not None})  # UserError if bad
        return Job(sender=sender, prompt=prompt, max_tokens=max_tokens,
                   stream=bool(stream[0]) if stream is not None else False, chat=chat,
                   end_id=int(end_id[0]) if end_id is not None else None,
                   stop_words=[w for w in (_decode(b, "stop_words") for b in stop) if w] if stop is not None else [],
                   prompt_tokens=len(ids), sampling=dataclasses.asdict(sampling))

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self._run(job)
                continue
            except Shutdown:
                error = _error("the server is shutting down", "UNAVAILABLE")
            except Cancelled:  # the final flag still goes out, so Triton can retire the request
                error = _error("the request was cancelled", "CANCELLED")
            except Exception as e:  # a failure in one request must not stop the worker
                error = _error(f"generation failed: {type(e).__name__}: {e}", "INTERNAL")
            finally:
                self.jobs.task_done()  # frees a waiting `execute` (several instances)
            try:
                _send(job.sender, error, final=True)
            except Exception:
                pass  # the client is gone

    def _run(self, job: Job) -> None:
        gen = self.llm.stream_tokens(job.prompt, job.max_tokens, job.chat, **job.sampling)
        text, ids = "", []  # what was generated so far (text: cut at a stop word or end_id)
        try:
            while True:
                if self._stopping():
                    raise Shutdown()
                if job.sender.is_cancelled():  # the client cancelled or went away: `finally` frees the model
                    raise Cancelled()
                try:
                    piece, toks = next(gen)
                except StopIteration as stop:
                    stats = stop.value.stats
                    break
                ids += toks
                cut = self._stop_at(job, text + piece, ids)
                if cut is not None:
                    piece = (text + piece)[len(text):cut]
                text += piece
                if job.stream and piece:
                    _send(job.sender, _response(piece))
                if cut is not None:
                    stats = _end_early(gen)
                    break
        finally:
            gen.close()  # releases the LLM's lock if we stopped early
        _send(job.sender, _response("" if job.stream else text, stats), final=True)

    def _stop_at(self, job: Job, text: str, ids: list[int]) -> int | None:
        """Where the output ends because of the request's end_id or stop words (they are not part of it)."""
        cuts = [i for i in (text.find(w) for w in job.stop_words) if i >= 0]
        if job.end_id is not None and job.end_id in ids:
            cuts.append(len(self.llm.tokenizer.decode(ids[: ids.index(job.end_id)])))
        return min(cuts) if cuts else None


def _end_early(gen) -> dict:
    """Ends a generation at a stop word or end_id; the executor still returns the request's statistics."""
    while True:
        try:
            gen.send(True)
        except StopIteration as stop:
            return stop.value.stats
