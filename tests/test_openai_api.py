"""`microspec serve --openai-port` on the real tritonserver, driven by the real `openai` client: completions and chat,
streamed and not, equal to the offline LLM's output; seeded sampling repeatable; stop sequences; every error class
with OpenAI's body; a client that goes away mid-request gives its KV blocks back (the metrics port says so)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from trtllm_microspec.models.registry import UserError

try:
    from trtllm_microspec.serving.server import pytriton_dir, stub_site

    pytriton_dir()
    stub_site(None)
    import fastapi  # noqa: F401
    import openai
    import uvicorn  # noqa: F401
except (UserError, ModuleNotFoundError) as e:
    pytest.skip(f"serve extra or openai not installed: {e}", allow_module_level=True)

import torch  # noqa: E402

from trtllm_microspec.llm import LLM  # noqa: E402
from trtllm_microspec.models.tokenizer import Tokenizer  # noqa: E402
from trtllm_microspec.serving.client import MAX_STOP_WORDS  # noqa: E402
from trtllm_microspec.serving.openai_api import MAX_BODY_BYTES, OpenAIFront  # noqa: E402
from trtllm_microspec.serving.server import running, stub_pids  # noqa: E402

from test_serving import SMALL_TREE, free_ports  # noqa: E402

MAX_SEQ_LEN = 512
# small, so that a full queue is cheap to reach (the 5th long request is refused); not 1: Triton's queue counts the
# requests it has not yet handed to the model, so of two arriving together one would be refused with room to spare
MAX_BATCH, MAX_QUEUE = 2, 2
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12
SAMPLED = {"temperature": 1.5, "top_p": 0.875, "seed": 7}  # exact in fp32, the model's input type
LONG_PROMPT, LONG = "1, 2, 3, 4, 5, 6, 7, 8,", 300  # counting on: a request that runs long unless cancelled


class Served:
    def __init__(self, proc, host, openai_port, grpc_port, metrics_port, err: Path):
        self.proc, self.host, self.metrics_port, self.err = proc, host, metrics_port, err
        self.grpc_url = f"{host}:{grpc_port}"
        self.port = openai_port
        self.url = f"http://{host}:{openai_port}/v1"
        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=300)

    def stderr(self) -> str:
        return self.err.read_text()

    def triton(self) -> int:
        """serve's tritonserver (the one restarted after a failure)."""
        (pid,) = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == self.proc.pid
                  and (p / "cmdline").read_bytes().split(b"\0", 1)[0].endswith(b"tritonserver")]
        return pid


def _ppid(p: Path) -> int | None:
    try:
        return int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.fixture(scope="module")
def served(engine_dir, random_draft_dir):
    """`microspec serve --openai-port` as a user starts it, once for the module."""
    http_port, grpc, metrics, port = free_ports(4)
    cmd = [sys.executable, "-m", "trtllm_microspec.cli", "serve", "--engine", str(engine_dir), "--draft",
           str(random_draft_dir), "--device", "cpu", "--max-seq-len", str(MAX_SEQ_LEN), *SMALL_TREE, "--spec-policy", "fixed",
           "--max-batch", str(MAX_BATCH), "--max-queue-size", str(MAX_QUEUE), "--http-port", str(http_port),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(port)]
    err = tempfile.NamedTemporaryFile("w+", prefix="serve-stderr-", suffix=".txt")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(6)]
        assert "ready" in lines[0], (lines, Path(err.name).read_text())
        assert f"OpenAI   http://127.0.0.1:{port}/v1" in "".join(lines)
        served = Served(proc, "127.0.0.1", port, grpc, metrics, Path(err.name))
        yield served
        # SIGTERM: the shutdown said once, exit 0, then tritonserver, its stub and the front's port are all gone
        triton = served.triton()
        stubs = stub_pids(triton)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        tail = served.stderr().splitlines()
        assert tail.count("microspec serve: SIGTERM, shutting down") == 1 and tail[-1] == "microspec serve: stopped"
        assert not running(triton) and not any(running(s) for s in stubs)
        with socket.socket() as probe:  # the front closed its socket (a listener fails this, TIME_WAIT not)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()


class Offline:
    """The LLM API on the same engine, method and knobs; each output computed once."""

    def __init__(self, llm: LLM):
        self.llm, self.cache = llm, {}

    def generate(self, prompt, max_tokens: int, chat: bool = False, **sampling):
        key = json.dumps([prompt, max_tokens, chat, sampling])
        if key not in self.cache:
            self.cache[key] = self.llm.generate(prompt, max_tokens, chat=chat, **sampling)
        return self.cache[key]


@pytest.fixture(scope="module")
def offline(engine_dir, random_draft_dir):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the other core is the server's
    yield Offline(LLM(engine_dir, method="microspec", draft=random_draft_dir, device="cpu", max_seq_len=MAX_SEQ_LEN,
                      depth=3, top_k=8, total_tokens=16, spec_policy="fixed"))
    torch.set_num_threads(n)


def gauges(served) -> dict[str, float]:
    conn = http.client.HTTPConnection(served.host, served.metrics_port, timeout=30)
    conn.request("GET", "/metrics")
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines
            if ln.startswith(("microspec_", "nv_inference_pending_request_count"))}


def idle_after(served, timeout: float) -> float:
    """Seconds until nothing runs and no KV block is held; fails after `timeout`."""
    t0 = time.monotonic()
    while (g := gauges(served))["microspec_running_requests"] or g["microspec_kv_blocks_used"]:
        assert time.monotonic() - t0 < timeout, g
        time.sleep(0.05)
    return time.monotonic() - t0


def test_models(served):
    assert [m.id for m in served.client.models.list().data] == ["microspec"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_offline(served, offline, stream):
    want = offline.generate(PROMPT, MAX_TOKENS)
    args = dict(model="microspec", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        r = served.client.completions.create(**args)
        text, finish, usage, extra = r.choices[0].text, r.choices[0].finish_reason, r.usage, r.model_extra
    else:
        chunks = list(served.client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        assert len(chunks) > 3  # pieces as they came, the finish chunk, the usage chunk
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish, usage, extra = chunks[-2].choices[0].finish_reason, chunks[-1].usage, chunks[-2].model_extra
    assert text == want.text
    assert finish == ("length" if want.num_new_tokens == MAX_TOKENS else "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.stats["prompt_tokens"], want.num_new_tokens)
    assert usage.prompt_tokens_details.cached_tokens == want.stats["cached_tokens"]
    assert extra["microspec"]["acceptance_length"] == pytest.approx(want.stats["acceptance_length"], rel=1e-5)
    assert extra["microspec"]["mean_active_vocab"] > 0  # the draft really ran with a MicroSpec window


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline(served, offline, stream):
    want = offline.generate(MESSAGES, MAX_TOKENS, chat=True)
    args = dict(model="microspec", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        r = served.client.chat.completions.create(**args)
        assert r.choices[0].message.role == "assistant"
        text, usage = r.choices[0].message.content, r.usage
    else:
        chunks = list(served.client.chat.completions.create(**args, stream=True,
                                                            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(pieces) > 1
        text, usage = "".join(pieces), chunks[-1].usage
    assert text == want.text
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.stats["prompt_tokens"], want.num_new_tokens)


def test_a_request_may_ask_not_to_speculate(served, offline):
    """`speculate: false` (extra_body): the same text, decoded as AR's (no round: null acceptance)."""
    r = served.client.completions.create(model="microspec", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"speculate": False})
    assert r.choices[0].text == offline.generate(PROMPT, MAX_TOKENS).text
    assert r.model_extra["microspec"]["acceptance_length"] is None


def test_sampled_with_a_seed_is_repeatable(served, offline):
    want = offline.generate(MESSAGES, MAX_TOKENS, chat=True, **SAMPLED).text
    assert want != offline.generate(MESSAGES, MAX_TOKENS, chat=True).text  # it really sampled
    args = dict(model="microspec", messages=MESSAGES, max_tokens=MAX_TOKENS, **SAMPLED)
    assert served.client.chat.completions.create(**args).choices[0].message.content == want
    streamed = served.client.chat.completions.create(**args, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want
    other = served.client.chat.completions.create(**{**args, "seed": 8}).choices[0].message.content
    assert other != want


def test_stop_sequences(served, offline):
    """The text ends right before the first stop sequence, streamed or not. Streamed, the stop sequence spans two
    pieces: its first part is held back, not sent, until the next piece shows whether it is one."""
    want = offline.generate(PROMPT, MAX_TOKENS).text
    args = dict(model="microspec", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    pieces = [c.choices[0].text for c in served.client.completions.create(**args, stream=True)]
    at = next(i for i in range(1, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    stop = pieces[at][-1] + pieces[at + 1][:2]  # the last character of one piece, the first two of the next
    args["stop"] = [stop, "never"]
    r = served.client.completions.create(**args)
    assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in served.client.completions.create(**args, stream=True))
    assert streamed == want[:want.index(stop)]


def raw(served, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(served.host, served.port, timeout=120)
    conn.request(method, path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


CHAT = {"model": "microspec", "messages": MESSAGES, "max_tokens": 4}
# (body changes, status, param, the message's beginning); the completions endpoint takes the same checks
BAD = [({"model": "gpt-4"}, 404, "model", "the model 'gpt-4' does not exist"),
       ({"n": 2}, 400, "n", "n must be 1"),
       ({"max_tokens": 0}, 400, "max_tokens", "max_tokens: Input should be greater than or equal to 1"),
       ({"max_tokens": MAX_SEQ_LEN + 1}, 400, "max_tokens", "max_tokens must be between 1 and"),  # the model's
       ({"temperature": -1}, 400, "temperature", "temperature must be a finite number >= 0"),
       ({"top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1]"),
       ({"seed": -1}, 400, "seed", "seed: Input should be greater than or equal to 0"),
       ({"logprobs": True}, 400, "logprobs", "logprobs is not supported"),
       ({"extra_body": {"speculate": "maybe"}}, 400, "speculate", "speculate: Input should be a valid boolean"),
       ({"messages": []}, 400, "messages", "messages: List should have at least 1 item"),
       ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", "messages.0.role: Input"),
       ({"messages": [{"role": "user", "content": "hello " * MAX_SEQ_LEN}]}, 400, None, "the prompt has"),
       # of the union (a string, or a list of text parts) the member the value went into names what is wrong
       ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
        400, "messages.0.content.0.type", "messages.0.content.0.type: Input should be 'text'"),
       ({"stop": ["a"] * (MAX_STOP_WORDS + 1)}, 400, "stop", f"stop: at most {MAX_STOP_WORDS} stop sequences")]


@pytest.mark.parametrize("change, status, param, message", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_requests_get_openai_errors(served, change, status, param, message):
    with pytest.raises(openai.APIStatusError) as e:
        served.client.chat.completions.create(**{**CHAT, **change})
    error = e.value.body
    assert e.value.status_code == status and error["param"] == param, error
    assert error["message"].startswith(message) and "\n" not in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_bad_bodies_and_routes(served, offline):
    assert raw(served, "POST", "/v1/chat/completions", b"{not json") == (
        400, {"error": {"message": "the body is not valid JSON: key must be a string at line 1 column 2",
                        "type": "invalid_request_error", "param": None, "code": None}})
    # a lone surrogate is no character: a 400 that says where, not a 500 from encoding it for the model
    status, body = raw(served, "POST", "/v1/completions", b'{"model": "microspec", "prompt": "a\\ud800"}')
    assert (status, body["error"]["message"]) == (400, "the body is not valid JSON: unexpected end of hex escape at "
                                                       "line 1 column 42")
    status, body = raw(served, "POST", "/v1/completions", json.dumps({"model": "microspec", "prompt": [1, 2]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt.0"
    status, body = raw(served, "POST", "/v1/completions", json.dumps({"model": "microspec", "prompt": ["a", "b"]})
                       .encode())
    assert status == 400 and body["error"]["message"].startswith("prompt: one prompt per request")
    # a body over the cap is read to its end and dropped, not parsed: 413, and the client gets it
    status, body = raw(served, "POST", "/v1/chat/completions", b" " * (MAX_BODY_BYTES + 1))
    assert (status, body["error"]["message"]) == (413, f"the body is {MAX_BODY_BYTES + 1} bytes: this server takes at "
                                                       f"most {MAX_BODY_BYTES} (16 MiB)")
    assert raw(served, "GET", "/v1/embeddings")[0] == 404
    assert raw(served, "GET", "/v1/completions")[0] == 405
    with pytest.raises(openai.BadRequestError):  # streamed, a refusal still comes before any event, as a status
        list(served.client.completions.create(model="microspec", prompt="Hi", max_tokens=MAX_SEQ_LEN + 1,
                                              stream=True))
    # and it keeps serving
    r = served.client.completions.create(model="microspec", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == offline.generate(PROMPT, MAX_TOKENS).text


def long_stream(served):
    """A long greedy stream, its first piece read (so the model holds it)."""
    stream = served.client.completions.create(model="microspec", prompt=LONG_PROMPT, max_tokens=LONG,
                                              temperature=0, stream=True)
    assert next(iter(stream)).choices[0].text
    return stream


def per_token_s(offline) -> float:
    r = offline.generate(LONG_PROMPT, 24)
    return r.stats["wall_s"] / r.num_new_tokens


def test_queue_full_is_429_and_abandoned_streams_free_their_blocks(served, offline):
    """MAX_BATCH running + MAX_QUEUE waiting in Triton's queue: the next request is refused by Triton's queue, which
    the front answers with 429 (streamed or not). Streams the client closes are cancelled: their blocks go back long
    before they could have finished."""
    held = [long_stream(served) for _ in range(MAX_BATCH)]
    queued = []  # a queued one's headers come with its first piece, once it runs: wait for them on threads
    waiters = [threading.Thread(target=lambda: queued.append(long_stream(served))) for _ in range(MAX_QUEUE)]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + 60
    while (g := gauges(served))["nv_inference_pending_request_count"] < MAX_QUEUE:  # in Triton's queue
        assert time.monotonic() < deadline, g
        time.sleep(0.05)
    assert g["microspec_running_requests"] == MAX_BATCH and g["microspec_kv_blocks_used"] > 0
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as e:
            r = served.client.completions.create(model="microspec", prompt="Hi", max_tokens=4, stream=stream)
            list(r) if stream else None
        assert e.value.body["code"] == "queue_full" and "Exceeds maximum queue size" in e.value.body["message"]
    for s in held:
        s.close()  # the HTTP connection drops: the queued requests get their places
    for w in waiters:
        w.join(timeout=60)
    assert len(queued) == MAX_QUEUE
    for s in queued:
        s.close()
    assert idle_after(served, 60) < LONG / 4 * per_token_s(offline)


def test_non_streamed_client_that_goes_away_frees_its_blocks(served, offline):
    body = json.dumps({"model": "microspec", "prompt": LONG_PROMPT, "max_tokens": LONG, "temperature": 0})
    conn = http.client.HTTPConnection(served.host, served.port, timeout=1.5)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(TimeoutError):  # no answer before the whole text: the client gives up
        conn.getresponse()
    g = gauges(served)
    conn.close()
    assert g["microspec_running_requests"] == 1 and g["microspec_kv_blocks_used"] > 0
    assert idle_after(served, 60) < LONG / 4 * per_token_s(offline)


def test_unreachable_triton_is_503_and_busy_port_is_refused(engine_dir):
    """A front whose Triton is gone (stopped, or never there) answers 503; a port in use fails at once."""
    (port, grpc) = free_ports(2)
    front = OpenAIFront("127.0.0.1", port).start(f"127.0.0.1:{grpc}", Tokenizer(engine_dir))
    try:
        client = openai.OpenAI(base_url=front.url, api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="microspec", prompt="Hi", max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "unavailable"
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use"):
            OpenAIFront("127.0.0.1", port)
    finally:
        front.stop()


def test_our_own_fault_is_500(engine_dir, monkeypatch):
    """An exception of the front itself is a 500 with OpenAI's body, and the front keeps serving."""
    from trtllm_microspec.serving import openai_api

    (port, grpc) = free_ports(2)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        raise openai_api.APIError(400, "fine again")

    monkeypatch.setattr(openai_api, "make_inputs", broken)
    front = OpenAIFront("127.0.0.1", port).start(f"127.0.0.1:{grpc}", Tokenizer(engine_dir))
    try:
        client = openai.OpenAI(base_url=front.url, api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="microspec", prompt="Hi", max_tokens=4)
        assert e.value.status_code == 500 and e.value.body["message"] == "RuntimeError: a bug"
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="microspec", prompt="Hi", max_tokens=4)
    finally:
        front.stop()


def test_openai_and_grpc_requests_share_the_batch(served, offline):
    """An OpenAI stream and a gRPC stream at once run together in the one batch, each with its own text."""
    from trtllm_microspec.serving import client as grpc_client

    via_openai = iter(served.client.completions.create(model="microspec", prompt=LONG_PROMPT, max_tokens=48,
                                                       temperature=0, stream=True))
    via_grpc = grpc_client.stream(served.grpc_url, PROMPT, MAX_TOKENS)
    pieces = [next(via_openai).choices[0].text], [next(via_grpc)]
    deadline = time.monotonic() + 10  # the gauges are set after the step that sent the first pieces
    while gauges(served)["microspec_running_requests"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pieces[0].extend(c.choices[0].text for c in via_openai)
    pieces[1].extend(via_grpc)
    assert ["".join(p) for p in pieces] == [offline.generate(LONG_PROMPT, 48).text,
                                            offline.generate(PROMPT, MAX_TOKENS).text]


@pytest.mark.parametrize("chat", [False, True])
def test_microspec_client_over_openai_equals_grpc(served, offline, chat):
    """`microspec client --url http://.../v1` runs the request the gRPC address runs: same text and statistics."""
    from trtllm_microspec.serving import client as grpc_client

    want = offline.generate(MESSAGES[1:] if chat else PROMPT, MAX_TOKENS, chat=chat)
    prompt = MESSAGES[1]["content"] if chat else PROMPT
    for stream in (True, False):
        via_openai = grpc_client.generate(served.url, prompt, MAX_TOKENS, stream=stream, chat=chat)
        via_grpc = grpc_client.generate(served.grpc_url, prompt, MAX_TOKENS, stream=stream, chat=chat)
        assert via_openai.text == via_grpc.text == want.text
        assert via_openai.stats == pytest.approx(via_grpc.stats)
        assert via_openai.stats["num_output_tokens"] == want.num_new_tokens
        assert len(via_openai.pieces) > 1 if stream else len(via_openai.pieces) == 1


def test_load_and_bench_over_openai(served, tmp_path, capsys):
    """The load mode and `bench --server` take the OpenAI endpoint like the gRPC address."""
    from trtllm_microspec.cli import main
    from trtllm_microspec.serving import client as grpc_client

    r = grpc_client.load(served.url, [PROMPT, LONG_PROMPT], concurrency=2, requests=2, max_tokens=8)
    assert (r["completed"], r["errors"], r["output_tokens"]) == (2, [], 16)
    assert r["ttft_s"]["p50"] > 0 and r["itl_s"]["p50"] > 0
    data = tmp_path / "data"  # two questions in Spec-Bench's format
    (data / "spec_bench").mkdir(parents=True)
    (data / "spec_bench" / "question.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "translation", "turns": [t]}) + "\n"
        for i, t in enumerate(["Translate to French: good morning.", "Translate to German: thank you."])))
    main(["bench", "--server", served.url, "--concurrency", "1,2", "--categories", "translation", "--data", str(data),
          "--max-new-tokens", "6", "--warmup", "0", "--requests", "3", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())  # --requests 3 of the 2 questions: one repeated
    assert [(x["concurrency"], x["completed"], x["errors"]) for x in res["levels"]] == [(1, 3, []), (2, 3, [])]
    assert res["levels"][1]["output_tokens"] == 18 and "| 2 | 3/3 |" in (tmp_path / "results.md").read_text()
    with pytest.raises(SystemExit) as e:
        main(["client", "--url", served.url, "--prompt", "Hi", "--end-id", "3"])
    assert e.value.code == 2 and "end_id is not part of the OpenAI API" in capsys.readouterr().err


def test_model_process_killed_front_answers_503_then_serves_again(served, offline):
    """Last (it restarts the module's server): the model's process dies; serve restarts tritonserver on the same gRPC
    port, and the front, meanwhile answering 503, serves correctly again within seconds of Triton being ready."""
    (stub,) = stub_pids(served.triton())
    os.kill(stub, signal.SIGKILL)
    killed, failures = time.monotonic(), []  # (when the attempt began, its status, its code)
    while True:
        sent = time.monotonic()
        try:
            r = served.client.completions.create(model="microspec", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                 temperature=0)
            break
        except openai.APIStatusError as e:
            failures.append((sent, e.status_code, e.body["code"]))
            assert time.monotonic() - killed < 300, served.stderr()
            time.sleep(0.2)
    assert r.choices[0].text == offline.generate(PROMPT, MAX_TOKENS).text
    assert failures and {f[1:] for f in failures} == {(503, "unavailable")}, failures
    # serve polls readiness (and logs "ready again") after the front may already have been answered
    deadline = time.monotonic() + 10
    while "ready again in" not in (err := served.stderr()):
        assert time.monotonic() < deadline, err
        time.sleep(0.1)
    assert f"the model's process (pid {stub}) died" in err
    # no request sent 2 s after Triton was ready again failed: the front reconnected within its 1 s backoff cap, not
    # after gRPC's default backoff (grown to ~10 s or more after a minute down)
    ready_at = killed + float(err.split("ready again in ")[1].split()[0])
    assert not [t - ready_at for t, *_ in failures if t > ready_at + 2], (failures, ready_at, err)
