"""Faults an operator meets, against the real tritonserver on the CPU: the model's process killed under load (serve
fails the requests in flight at once and restarts, or exits), `microspec serve` killed with SIGKILL (nothing left
behind; the next start reaps what it left), heavy bodies (refused before tokenising, the others not held up),
overload and bad requests (each error class with its gRPC status name and HTTP code), and a bounded soak."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_serving import (LONG, LONG_PROMPT, MAX_TOKENS, PROMPTS, args, concurrently, free_ports,  # noqa: F401
                          gauges, offline, one_thread, raw_inputs, serve_args, wait_idle)
from trtllm_microspec.serving import client
from trtllm_microspec.serving.server import TritonServer, model_params, running, stub_pids, write_repository

import numpy as np  # noqa: E402  (after test_serving: it skips this module too without the serve extra)

MAX_BATCH, QUEUE = 2, 4  # small, so that a few requests fill the engine and Triton's queue


class Serve:
    """`microspec serve` as an operator starts it: a subprocess on free ports, its stderr in a file."""

    def __init__(self, args, ports=None, *extra):
        self.http, self.grpc, self.metrics = ports or free_ports(3)
        self.url = f"127.0.0.1:{self.grpc}"
        self.err = tempfile.NamedTemporaryFile("w+", prefix="serve-stderr-", suffix=".txt")
        cmd = [sys.executable, "-m", "trtllm_microspec.cli", *args, "--http-port", str(self.http), "--grpc-port",
               str(self.grpc), "--metrics-port", str(self.metrics), "--exit-timeout", "2", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err, text=True)
        line = self.proc.stdout.readline()  # "microspec ready in 12.3 s"
        assert "ready" in line, self.stderr()
        self.ready_s = float(line.split(" in ")[1].split()[0])

    def stderr(self) -> str:
        return Path(self.err.name).read_text()

    def triton(self) -> int:
        (pid,) = [c for c in children(self.proc.pid) if _argv0(c).endswith(b"tritonserver")]
        return pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _argv0(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return b""


def ready(http_port: int) -> bool:
    """Triton's readiness probe as a load balancer reads it: a 200, or not ready (an error or no answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_until(predicate, timeout: float, step: float = 0.05) -> float | None:
    """Seconds until predicate() held, or None after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def streams_in_flight(url: str, n: int) -> tuple[list, list[threading.Thread]]:
    """n long streams on threads; each records (seconds since its start of the failure, its RequestError) or 'done'."""
    outcomes: list = []

    def one():
        t0 = time.monotonic()
        try:
            client.generate(url, LONG_PROMPT, LONG, stream=True, timeout=120)
            outcomes.append("done")
        except client.RequestError as e:
            outcomes.append((time.monotonic(), e))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return outcomes, threads


@pytest.fixture(scope="module")
def fault_args(engine_dir, random_draft_dir):
    return serve_args(engine_dir, random_draft_dir, "--max-batch", str(MAX_BATCH), "--max-queue-size", str(QUEUE))


def test_model_process_killed_under_load_fails_in_flight_requests_and_restarts(fault_args, offline):
    serve = Serve(fault_args)
    try:
        outcomes, threads = streams_in_flight(serve.url, MAX_BATCH + 2)  # the engine full, two more in Triton's queue
        assert wait_until(lambda: gauges_at(serve)["microspec_running_requests"] == MAX_BATCH, 60) is not None
        (stub,) = stub_pids(serve.triton())
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: not ready(serve.http), 2) is not None  # readiness false within 2 s
        for t in threads:
            t.join(timeout=max(0.0, killed + 10 - time.monotonic()))
        assert len(outcomes) == MAX_BATCH + 2 and "done" not in outcomes
        assert all(at - killed < 10 and e.code == "UNAVAILABLE" for at, e in outcomes), outcomes  # each an error
        # answered correctly again within 60 s (or, on a machine busier than CI, 1.5 x the first start)
        answered_again(serve, killed, offline, 1)
        err = serve.stderr()
        assert f"the model's process (pid {stub}) died" in err and "restarting tritonserver (restart 1)" in err
        assert ready(serve.http) and not running(stub)
        # tritonserver 2.51's HTTP generate segfaults on a body over ~4 MB (triton-inference-server/server#5840):
        # a crash is restarted the same way
        triton = serve.triton()
        with pytest.raises((urllib.error.URLError, OSError)):  # the connection drops: no answer
            http_post(serve, json.dumps({"text_input": "a" * (5 << 20), "max_tokens": 8}).encode())
        assert wait_until(lambda: not running(triton), 10) is not None  # it may drop the connection first
        answered_again(serve, time.monotonic(), offline, 2)
        assert f"tritonserver (pid {triton}) crashed with SIGSEGV" in serve.stderr()
    finally:
        serve.stop()
    assert serve.proc.returncode == 0


def answered_again(serve: Serve, since: float, offline, restarts: int) -> None:
    """The reference request is answered correctly again within 60 s of `since` (on a machine busier than CI:
    1.5 x serve's first start), and serve says it is ready again."""
    deadline = since + max(60.0, 1.5 * serve.ready_s)
    while True:
        try:
            got = client.generate(serve.url, PROMPTS[2], MAX_TOKENS, timeout=60)
            break
        except client.RequestError:
            assert time.monotonic() < deadline, serve.stderr()
            time.sleep(0.5)
    assert got.text == offline(PROMPTS[2]).text
    # serve polls readiness after the client may already have been answered
    assert wait_until(lambda: serve.stderr().count("ready again in") == restarts, 5) is not None, serve.stderr()


def gauges_at(serve: Serve) -> dict[str, float]:
    class At:
        host, metrics_port = "127.0.0.1", serve.metrics
    try:
        return gauges(At)
    except (urllib.error.URLError, OSError):
        return {"microspec_running_requests": -1}


def test_sigkill_of_serve_leaves_nothing_and_the_next_start_reaps(fault_args):
    first = Serve(fault_args)
    triton = first.triton()
    (stub,) = stub_pids(triton)
    left = sorted(Path(tempfile.gettempdir()).glob(f"microspec-*-{first.proc.pid}-*"))
    assert {p.name.split("-")[1] for p in left} == {"serve", "repo"}
    first.proc.kill()  # SIGKILL: serve cleans up nothing
    first.proc.wait()
    first.err.close()
    # tritonserver gets SIGKILL from the kernel (its parent-death signal); its stub exits once its parent is gone
    assert wait_until(lambda: not running(triton) and not running(stub), 5) is not None
    shm = list(Path("/dev/shm").glob(f"microspec_{first.proc.pid}_*"))
    assert all(p.exists() for p in left)  # still there: nobody removed them
    # a new serve on the same ports starts, and reaps the dead one's folders and shared memory; in exit mode the
    # model's death ends it with one line and a non-zero code
    second = Serve(fault_args, (first.http, first.grpc, first.metrics), "--on-model-failure", "exit")
    try:
        assert not any(p.exists() for p in left + shm)
        assert f"removed {left[0]}" in second.stderr()
        (stub,) = stub_pids(second.triton())
        os.kill(stub, signal.SIGKILL)
        assert second.proc.wait(timeout=10) == 2
        last = second.stderr().strip().splitlines()[-1]
        assert last == f"microspec: error: the model's process (pid {stub}) died (--on-model-failure exit)"
        assert not ready(second.http)
    finally:
        second.stop()


@pytest.fixture(scope="module")
def server(fault_args, tmp_path_factory):
    from trtllm_microspec.cli import build_parser

    a = build_parser().parse_args(fault_args)
    repo = write_repository(tmp_path_factory.mktemp("repo"), model_params(a), queue=QUEUE)
    http, grpc, metrics = free_ports(3)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics) as s:
        s.wait_ready(timeout=600)
        yield s


def http_post(server, body: bytes, stream: bool = False) -> tuple[int, str]:
    """Triton's generate extension: (HTTP code, the body's error message or its text_output)."""
    url = f"http://127.0.0.1:{server.http}/v2/models/microspec/generate{'_stream' if stream else ''}" \
        if isinstance(server, Serve) else \
        f"http://{server.host}:{server.http_port}/v2/models/microspec/generate{'_stream' if stream else ''}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode().removeprefix("data: "))["error"]


def test_heavy_bodies_cost_only_their_own_clients(server, offline):
    """Bodies of 5 MB arrive together: each is refused (INVALID_ARGUMENT; HTTP 400) by its size before it is
    decoded or tokenised, and a valid request sent among them is answered correctly, not seconds per body later."""
    def ttft() -> float:
        got = client.generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, stream=True, timeout=120)
        assert got.text == offline(PROMPTS[0]).text
        return got.ttft_s

    alone = min(ttft() for _ in range(3))
    heavy = client.make_inputs("a" * (5 << 20), 8)

    def refused() -> str:
        with pytest.raises(client.RequestError) as e:
            list(client.stream_infer(server.grpc_url, heavy, timeout=120))
        return f"{e.value.code}: {e.value}"

    # As many bodies as Triton's queue holds beside the valid request: each body passes into the model's process
    # one after another, so more of them would wait in the queue at once and Triton would refuse some (and maybe
    # the valid request) as "Exceeds maximum queue size" before the model sees them (seen in CI with 10 bodies).
    heavies = QUEUE - 1
    start = threading.Barrier(heavies + 1)
    *errors, loaded = concurrently([lambda: (start.wait(), refused())[1] for _ in range(heavies)] +
                                   [lambda: (start.wait(), time.sleep(0.05), ttft())[2]])
    llm = offline.llm
    cap = llm.max_prompt  # tokens, each at most the longest token's spelling in bytes
    assert errors == [f"INVALID_ARGUMENT: text_input is 5242880 bytes: this engine holds at most {cap} prompt "
                      f"tokens, at most {cap * llm.tokenizer.max_token_bytes()} bytes"] * heavies
    print(f"TTFT alone {alone * 1e3:.0f} ms, among {heavies} x 5 MB bodies {loaded * 1e3:.0f} ms")
    # Each body still passes through Triton's gRPC front and into the model's process one after another (~60-80 ms
    # each, measured with a model that only reads its input), ahead of the reference in Triton's queue: on an idle
    # 2-core machine 113 ms alone, 1.75 s among 10 of them (before the size check: 26.85 s, 2.7 s of tokenising each).
    # Not the 2x; the bound says that no body is tokenised or holds the engine.
    assert loaded <= 2 * alone + 5.0
    # over HTTP (below the ~4 MB that crash tritonserver's generate endpoint, see above): 400
    code, message = http_post(server, json.dumps({"text_input": "a" * (3 << 20), "max_tokens": 8}).encode())
    assert code == 400 and message.startswith("text_input is 3145728 bytes")


ERRORS = {  # case -> (gRPC inputs, the same as an HTTP body or None, the message)
    "missing text_input": (raw_inputs(max_tokens=([8], np.int32, "INT32"), stream=([True], np.bool_, "BOOL")),
                           {"max_tokens": 8, "stream": True}, "the request has no text_input (a required input)"),
    "missing max_tokens": (raw_inputs(text_input=([b"Hi"], np.object_, "BYTES"), stream=([True], np.bool_, "BOOL")),
                           {"text_input": "Hi", "stream": True}, "the request has no max_tokens (a required input)"),
    "end_id -5": (client.make_inputs("Hi", 8, end_id=-5), {"text_input": "Hi", "max_tokens": 8, "end_id": -5},
                  "end_id must be a token id between 0 and 49151, got -5"),
    "end_id 10^9": (client.make_inputs("Hi", 8, end_id=10 ** 9), None,
                    "end_id must be a token id between 0 and 49151, got 1000000000"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_is_invalid_argument_and_http_400(server, case):
    inputs, body, message = ERRORS[case]
    with pytest.raises(client.RequestError) as e:
        list(client.stream_infer(server.grpc_url, inputs, timeout=60))
    assert str(e.value) == message and e.value.code == "INVALID_ARGUMENT"
    if body is not None:
        assert http_post(server, json.dumps(body).encode()) == (400, message)


def test_overload_is_unavailable_and_http_503(server, offline):
    """Beyond the engine's places and Triton's queue (--max-queue-size) requests are refused at once as
    UNAVAILABLE: HTTP 503, over gRPC the message that error_code reads as UNAVAILABLE; the others finish."""
    n = MAX_BATCH + QUEUE  # running (the last one holding execute until one ends), and Triton's queue
    outcomes, threads = streams_in_flight(server.grpc_url, n + 3)
    assert wait_until(lambda: gauges(server)["microspec_running_requests"] == MAX_BATCH, 60) is not None
    time.sleep(1)  # all of them have reached the server
    code, message = http_post(server, json.dumps({"text_input": "Hi", "max_tokens": 8}).encode())
    assert code == 503 and "Exceeds maximum queue size" in message
    for t in threads:
        t.join(timeout=300)
    refused = [e for o in outcomes if o != "done" for e in [o[1]]]
    assert len(refused) == 3 and all("Exceeds maximum queue size" in str(e) and e.code == "UNAVAILABLE"
                                     for e in refused)
    assert outcomes.count("done") == n
    wait_idle(server)


def test_soak_loses_nothing(server, offline):
    """Requests from one client fewer than the server holds (running and queued: a client's next request may come
    before Triton has moved its queue on) for ~60 s, streamed and not, over gRPC and HTTP: every one answered with its
    offline text, then the batch empty and its blocks back."""
    cases = [(PROMPTS[i % len(PROMPTS)], (4, 8, 16)[i % 3]) for i in range(12)]
    want = {c: offline(*c).text for c in cases}
    deadline, errors, done = time.monotonic() + 60, [], []

    def worker(w: int):
        i = w
        while time.monotonic() < deadline:
            prompt, tokens = cases[i % len(cases)]
            try:
                if i % 4 == 3:
                    code, got = http_post(server, json.dumps({"text_input": prompt, "max_tokens": tokens}).encode())
                    got = json.loads(got)["text_output"] if code == 200 else f"HTTP {code}: {got}"
                else:
                    got = client.generate(server.grpc_url, prompt, tokens, stream=i % 2 == 0, timeout=120).text
            except client.RequestError as e:
                got = f"{e.code}: {e}"
            (done if got == want[prompt, tokens] else errors).append(got)
            i += clients

    clients = MAX_BATCH + QUEUE - 1
    concurrently([lambda w=w: worker(w) for w in range(clients)])
    assert not errors and len(done) >= 20, (errors[:3], len(done))
    g = wait_idle(server)
    assert g["microspec_waiting_requests"] == 0


def test_engine_loop_failure_ends_the_model_process(monkeypatch, capsys):
    """An error that escapes the engine loop ends the model's process with one line (which serve then restarts, as
    test_model_process_killed_under_load... shows) instead of leaving a ready model with no engine."""
    import types
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    from trtllm_microspec.serving import triton_model

    model = object.__new__(triton_model.TritonPythonModel)
    model._loop = lambda: {}["a request's job"]  # a KeyError, as a token for an ended job once raised
    exits = []
    monkeypatch.setattr(triton_model.os, "_exit", exits.append)
    model._engine()
    assert exits == [1]
    assert capsys.readouterr().err == ("microspec model: the engine loop failed (KeyError: \"a request's job\"); "
                                       "ending the model's process\n")


def test_held_back_tail_equals_the_prefix_search(monkeypatch):
    """The end of a streamed text that may begin a stop word (held back until the next tokens) is the longest one the
    plain search finds, comparing every prefix of the word, on random texts and words over a small alphabet."""
    import random
    import types
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    from trtllm_microspec.serving.triton_model import _held

    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 12)))
        word = "".join(rng.choice("ab ") for _ in range(rng.randint(1, 12)))
        assert _held(text, word) == max((k for k in range(1, len(word)) if text.endswith(word[:k])), default=0)
    assert _held("the end of a", "a" * 1_000_000) == 1  # a word far longer than the text: the text's tail only
