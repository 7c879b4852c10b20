"""A small gRPC client for the MicroSpec Triton model, and `microspec client` (one streamed request, or a load run).

    from trtllm_microspec.serving.client import stream, generate
    gen = stream("127.0.0.1:8001", "Tell me a story", max_tokens=64)
    for piece in gen: print(piece, end="", flush=True)     # generate() returns the Completion directly
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..engine.stats import percentiles
from ..models.registry import UserError, need

MODEL_NAME = "microspec"
# the most stop words one request may give (OpenAI allows 4): the engine loop searches each one after every step of
# the whole batch, so a request with thousands would slow every other request down
MAX_STOP_WORDS = 32
STAT_OUTPUTS = ("num_input_tokens", "num_output_tokens", "num_cached_tokens", "acceptance_length",
                "mean_active_vocab")
SAMPLING_INPUTS = {"temperature": (np.float32, "FP32"), "top_p": (np.float32, "FP32"), "top_k": (np.int32, "INT32"),
                   "random_seed": (np.uint64, "UINT64"), "speculate": (np.bool_, "BOOL")}


# Triton's gRPC stream carries a failed response's message only (no status code), so its class is read from the
# message: what the server says when it cannot take a request now (retry later), or when our own code failed
QUEUE_FULL = "Exceeds maximum queue size"  # Triton's own refusal once the model's queue (--max-queue-size) is full
UNAVAILABLE_MESSAGES = (QUEUE_FULL, "the server is shutting down")
INTERNAL_MESSAGES = ("generation failed", "internal error")


def error_code(message: str) -> str:
    """The class of a failed request's message: UNAVAILABLE (overload, shutdown: retry), CANCELLED, INTERNAL (the
    server's fault) or INVALID_ARGUMENT (the request's)."""
    if any(m in message for m in UNAVAILABLE_MESSAGES):
        return "UNAVAILABLE"
    if message.startswith("the request was cancelled"):
        return "CANCELLED"
    if message.startswith(INTERNAL_MESSAGES):
        return "INTERNAL"
    return "INVALID_ARGUMENT"


class RequestError(UserError):
    """The server refused or failed a request (the message is the server's), or the stream broke. `code`: the gRPC
    status name of its class (error_code; a broken connection: its own status, e.g. UNAVAILABLE)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code or error_code(message)


@dataclass
class Completion:
    text: str
    stats: dict  # the model's per-request statistics (STAT_OUTPUTS)
    ttft_s: float | None  # time to the first non-empty piece
    latency_s: float
    pieces: list[str] = field(default_factory=list)
    last_s: float | None = None  # time to the last non-empty piece


# gRPC's reconnect backoff grows to 2 minutes while a server is down (a restart takes a model load): capped at 1 s, a
# long-lived channel reaches a server within a second of its coming back, and fails fast until then. The message size
# options are tritonclient's own defaults, which channel_args replaces.
FAST_RECONNECT = [("grpc.max_send_message_length", 2 ** 31 - 1), ("grpc.max_receive_message_length", 2 ** 31 - 1),
                  ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]


def _grpc():
    try:
        import tritonclient.grpc as grpcclient
    except ModuleNotFoundError:
        raise UserError("tritonclient is not installed: pip install 'tritonclient[grpc]'") from None
    return grpcclient


def make_inputs(prompt: str | bytes, max_tokens: int, stream: bool = True, chat: bool = False,
                end_id: int | None = None, stop_words: list[str] | None = None, sampling: dict | None = None) -> list:
    """sampling: any of SAMPLING_INPUTS by name (temperature, top_p, top_k, random_seed, speculate); none: greedy."""
    grpcclient = _grpc()

    def tensor(name, values, dtype, triton_type):
        t = grpcclient.InferInput(name, [len(values)], triton_type)
        t.set_data_from_numpy(np.array(values, dtype=dtype))
        return t

    text = prompt.encode() if isinstance(prompt, str) else prompt
    inputs = [tensor("text_input", [text], np.object_, "BYTES"), tensor("max_tokens", [max_tokens], np.int32, "INT32"),
              tensor("stream", [stream], np.bool_, "BOOL"), tensor("chat", [chat], np.bool_, "BOOL")]
    if end_id is not None:
        inputs.append(tensor("end_id", [end_id], np.int32, "INT32"))
    if stop_words:
        inputs.append(tensor("stop_words", [w.encode() for w in stop_words], np.object_, "BYTES"))
    inputs += [tensor(name, [v], *SAMPLING_INPUTS[name]) for name, v in (sampling or {}).items()]
    return inputs


def stream_infer(url: str, inputs: list, model: str = MODEL_NAME,
                 timeout: float = 600) -> Generator[dict[str, np.ndarray], None, None]:
    """Yields each response's outputs (name -> array) over one gRPC stream; raises RequestError on an error
    response or when no response comes for `timeout` seconds. Closing the generator early cancels the request."""
    grpcclient = _grpc()
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
        try:
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        except InferenceServerException:  # the stream broke before the request went out (no server there)
            pass  # its callback has the reason, read below
        while True:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise RequestError(f"no response from {url} for {timeout:.0f} s", "DEADLINE_EXCEEDED") from None
            if error is not None:  # a failed response, or the stream itself broke (then with a gRPC status)
                status = error.status() if hasattr(error, "status") else None
                raise RequestError(error.message() if hasattr(error, "message") else str(error),
                                   status.rsplit(".", 1)[-1] if status else None)
            outputs = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
            if outputs:
                yield outputs
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def is_openai(url: str) -> bool:
    """An OpenAI endpoint's base URL (http://host:port/v1), not a gRPC address (host:port)."""
    return url.startswith(("http://", "https://"))


def stream(url: str, prompt: str | bytes, max_tokens: int = 256, stream: bool = True, chat: bool = False,
           end_id: int | None = None, stop_words: list[str] | None = None, model: str = MODEL_NAME,
           timeout: float = 600, sampling: dict | None = None) -> Generator[str, None, Completion]:
    """Yields text pieces as they arrive (one, the whole text, when stream=False); returns the Completion.
    url: the gRPC address (host:port), or the base URL of `serve --openai-port` (http://host:port/v1)."""
    t0 = time.perf_counter()
    ttft, last, pieces, stats = None, None, [], {}
    if is_openai(url):
        if end_id is not None:
            raise UserError("end_id is not part of the OpenAI API: use the gRPC address, or a stop word")
        outputs = openai_infer(url, prompt, max_tokens, stream, chat, stop_words, sampling, model, timeout)
    else:
        outputs = stream_infer(url, make_inputs(prompt, max_tokens, stream, chat, end_id, stop_words, sampling),
                               model, timeout)
    for out in outputs:
        piece = out["text_output"][0].decode()
        if piece:
            last = time.perf_counter() - t0
            ttft = ttft if ttft is not None else last
            pieces.append(piece)
            yield piece
        stats.update({k: none_if_nan(out[k][0].item()) for k in STAT_OUTPUTS if k in out})
    if not stats:  # the model's last response always has them: an empty final one means the request was cut off
        raise RequestError("the stream ended before the request completed")
    return Completion("".join(pieces), stats, ttft, time.perf_counter() - t0, pieces, last)


def openai_infer(base_url: str, prompt: str | bytes, max_tokens: int, stream: bool, chat: bool,
                 stop_words: list[str] | None, sampling: dict | None, model: str,
                 timeout: float) -> Generator[dict[str, np.ndarray], None, None]:
    """One request to the OpenAI endpoint, its answer as the gRPC outputs stream_infer yields (text pieces, then the
    statistics), so that both APIs are measured alike. Plain http.client, one connection per request (as the gRPC
    client opens a channel per request): the endpoint's cost, not an SDK's."""
    import http.client
    from urllib.parse import urlsplit

    text = prompt.decode() if isinstance(prompt, bytes) else prompt
    body = {"model": model, "max_tokens": max_tokens, "stream": stream, "temperature": 0.0}  # greedy unless asked
    body |= {"seed" if k == "random_seed" else k: v for k, v in (sampling or {}).items()}
    body |= {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    if stop_words:
        body["stop"] = stop_words
    if stream:
        body["stream_options"] = {"include_usage": True}  # the usage chunk: the request's token counts
    u = urlsplit(base_url)
    conn = (http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection)(u.netloc,
                                                                                              timeout=timeout)
    try:
        conn.request("POST", f"{u.path.rstrip('/')}/{'chat/completions' if chat else 'completions'}",
                     json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RequestError(_openai_message(r.read()))
        if not stream:
            obj = json.loads(r.read())
            c = obj["choices"][0]
            yield _outputs(c["message"]["content"] if chat else c["text"], obj["usage"], obj["microspec"])
            return
        usage = spec = None
        for line in r:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                raise RequestError(event["error"]["message"])
            if event["choices"]:
                c = event["choices"][0]
                spec = event.get("microspec", spec)  # on the finish chunk
                yield _outputs((c.get("delta") or {}).get("content") if chat else c.get("text"))
            usage = event.get("usage") or usage  # the last chunk (stream_options.include_usage)
        if usage is None or spec is None:
            raise RequestError("the stream ended before the request completed")
        yield _outputs("", usage, spec)
    except (OSError, http.client.HTTPException) as e:
        raise RequestError(f"{base_url}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()


def _openai_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


def _outputs(text: str | None, usage: dict | None = None, spec: dict | None = None) -> dict[str, np.ndarray]:
    """An OpenAI answer as the Triton model's outputs: text_output, and the STAT_OUTPUTS with the usage."""
    out = {"text_output": np.array([(text or "").encode()], dtype=np.object_)}
    if usage is not None:
        out |= {"num_input_tokens": np.array([usage["prompt_tokens"]]),
                "num_output_tokens": np.array([usage["completion_tokens"]]),
                "num_cached_tokens": np.array([(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)]),
                "acceptance_length": np.array([spec["acceptance_length"]]),
                "mean_active_vocab": np.array([spec["mean_active_vocab"]])}
    return out


def none_if_nan(v):
    """The model's NaN statistic (no speculative round ran) as None; other values as they are."""
    return None if isinstance(v, float) and v != v else v


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def generate(url: str, prompt: str | bytes, max_tokens: int = 256, **kw) -> Completion:
    gen = stream(url, prompt, max_tokens, **kw)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def load(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int, **kw) -> dict:
    """`requests` streaming requests from `concurrency` threads (prompts taken in turn): throughput and latency."""
    def one(i: int) -> Completion | str:
        try:
            return generate(url, prompts[i % len(prompts)], max_tokens, **kw)
        except RequestError as e:
            return str(e)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    return load_report(results, concurrency, time.perf_counter() - t0)


def load_report(results: list[Completion | str], concurrency: int, wall: float) -> dict:
    """Throughput and latency percentiles of a load run's results (a Completion, or the error of a failed request).
    A response may carry several tokens (a speculative round), so a request's inter-token latency is its mean:
    (last piece's arrival - first piece's) / (tokens - 1), for streamed requests of more than one piece."""
    done = [r for r in results if isinstance(r, Completion)]
    tokens = sum(c.stats.get("num_output_tokens", 0) for c in done)
    itl = [(c.last_s - c.ttft_s) / (c.stats["num_output_tokens"] - 1) for c in done
           if len(c.pieces) > 1 and c.stats.get("num_output_tokens", 0) > 1]
    return {"requests": len(results), "concurrency": concurrency, "completed": len(done),
            "errors": [r for r in results if isinstance(r, str)], "wall_s": wall,
            "requests_per_s": len(done) / wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "ttft_s": percentiles([c.ttft_s for c in done if c.ttft_s is not None]), "itl_s": percentiles(itl),
            "latency_s": percentiles([c.latency_s for c in done]),
            # over the requests that ran speculative rounds (None: none did)
            "mean_acceptance_length": float(np.mean(acc)) if (acc := [c.stats["acceptance_length"] for c in done
                                                                     if c.stats["acceptance_length"] is not None]) else None}


def cmd_client(a: argparse.Namespace) -> None:
    from ..cli import sampling_from_args

    s = sampling_from_args(a)  # a bad value is one line here, before any request
    for name, v, lo in (("--max-tokens", a.max_tokens, 1), ("--concurrency", a.concurrency, 1),
                        ("--requests", a.requests, 0)):
        need(name, v, lo)
    sampling = {"temperature": s["temperature"], "top_p": s["top_p"], "top_k": s["top_k"],
                **({"random_seed": s["seed"]} if s["seed"] is not None else {}),
                **({"speculate": False} if a.no_speculate else {})}
    kw = dict(stream=not a.no_stream, chat=a.chat, end_id=a.end_id, stop_words=a.stop, model=a.model,
              sampling=sampling)
    if a.requests:
        r = load(a.url, a.prompt, a.concurrency, a.requests, a.max_tokens, **kw)
        if a.json:
            print(json.dumps(r))
            return
        ms = lambda p: " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p.items() if v is not None)  # noqa: E731
        print(f"{r['completed']}/{r['requests']} requests at concurrency {r['concurrency']} in {r['wall_s']:.2f} s: "
              f"{r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
              f"mean acceptance length {fmt(r['mean_acceptance_length'], '.2f')}\n"
              f"  time to first token: {ms(r['ttft_s'])}\n  request latency:     {ms(r['latency_s'])}\n"
              f"  inter-token latency: {ms(r['itl_s']) or '- (no streamed request of two pieces or more)'}")
        for e in sorted(set(r["errors"])):
            print(f"  error ({r['errors'].count(e)}x): {e}", file=sys.stderr)
        if r["errors"]:
            sys.exit(1)
        return
    gen = stream(a.url, a.prompt[0], a.max_tokens, **kw)
    try:
        while True:
            print(next(gen), end="", flush=True)
    except StopIteration as stop:
        c = stop.value
    print()
    if a.json:
        print(json.dumps({"text": c.text, "stats": c.stats, "ttft_s": c.ttft_s, "latency_s": c.latency_s}))
        return
    s = c.stats
    print(f"[{s['num_output_tokens']} tokens in {c.latency_s:.2f} s, first after {(c.ttft_s or 0) * 1e3:.0f} ms, "
          f"acceptance {fmt(s['acceptance_length'], '.2f')}, vocab {fmt(s['mean_active_vocab'], '.0f')}]", file=sys.stderr)


def register(sub) -> None:
    from ..cli import add_sampling_args

    p = sub.add_parser("client", help="stream a request from `microspec serve`, or measure it under load")
    p.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC address (host:port), or the base URL "
                   "of its OpenAI endpoint (http://host:PORT/v1, serve --openai-port): both run the same requests")
    p.add_argument("--model", default=MODEL_NAME)
    p.add_argument("--prompt", action="append", required=True, help="repeat for several (load mode takes turns)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--end-id", type=int, help="stop at this token id")
    p.add_argument("--stop", action="append", help="stop word (repeatable); the output ends before it")
    p.add_argument("--concurrency", type=int, default=1, help="load mode: parallel clients")
    p.add_argument("--requests", type=int, default=0, help="load mode: total requests (0: one streamed request)")
    p.add_argument("--json", action="store_true", help="print the result or the load report as JSON")
    p.add_argument("--no-speculate", action="store_true", help="the requests decode as AR's on a speculative "
                   "server (the same tokens; no draft tree of their own)")
    add_sampling_args(p)
    p.set_defaults(func=cmd_client)
