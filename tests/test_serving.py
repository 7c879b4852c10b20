"""The real tritonserver (nvidia-pytriton wheel) serving MicroSpec on the CPU: outputs equal the offline LLM's,
streaming and not, batched under concurrency; bad requests get clear errors; cancellation and shutdown never wedge
it and give the batch's blocks back (the metrics port says so)."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from trtllm_microspec.models.registry import UserError

try:
    from trtllm_microspec.serving.server import pytriton_dir, stub_site

    pytriton_dir()
    stub_site(None)
except UserError as e:
    pytest.skip(f"serve extra not installed: {e}", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402

from trtllm_microspec.cli import build_parser  # noqa: E402
from trtllm_microspec.llm import LLM  # noqa: E402
from trtllm_microspec.serving import client  # noqa: E402
from trtllm_microspec.serving.server import (MODEL_PY, TritonServer, model_config, model_params,  # noqa: E402
                                             write_repository)

REPO = Path(__file__).resolve().parents[1] / "triton_repo"
MAX_SEQ_LEN = 256  # small, so that a prompt over the limit is cheap
SMALL_TREE = ["--depth", "3", "--tree-top-k", "8", "--total-tokens", "16"]  # any tree is lossless; this one is fast
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
MAX_TOKENS = 16


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def serve_args(engine_dir, draft_dir, *extra) -> list[str]:
    # --spec-policy fixed: these tests compare the server's round statistics with the offline ones; on a CPU the
    # auto policy may decode plainly (no rounds), which tests/test_policy.py covers
    return ["serve", "--engine", str(engine_dir), "--draft", str(draft_dir), "--device", "cpu",
            "--max-seq-len", str(MAX_SEQ_LEN), *SMALL_TREE, "--spec-policy", "fixed", *extra]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The offline reference computes on one thread, leaving the other core to the server: on 2 cores, two
    processes with two OpenMP threads each slow each other down several times over."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def args(engine_dir, random_draft_dir):
    return build_parser().parse_args(serve_args(engine_dir, random_draft_dir))


@pytest.fixture(scope="module")
def server(args, tmp_path_factory):
    repo = write_repository(tmp_path_factory.mktemp("repo"), model_params(args))
    http, grpc, metrics = free_ports(3)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics) as s:
        s.wait_ready(timeout=600)
        yield s


@pytest.fixture(scope="module")
def offline(args):
    llm = LLM(args.engine, method=args.method, draft=args.draft, device="cpu", max_seq_len=MAX_SEQ_LEN,
              depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens, spec_policy=args.spec_policy)
    cache = {}

    def reference(prompt: str, max_tokens: int = MAX_TOKENS):
        if (prompt, max_tokens) not in cache:
            cache[prompt, max_tokens] = llm.generate(prompt, max_tokens)
        return cache[prompt, max_tokens]

    reference.llm = llm
    return reference


def test_committed_repository_is_serve_defaults():
    defaults = build_parser().parse_args(["serve"])
    assert (REPO / "microspec" / "config.pbtxt").read_text() == model_config(model_params(defaults))
    assert (REPO / "microspec" / "1" / "model.py").read_text() == MODEL_PY


@pytest.mark.parametrize("stream", [True, False])
def test_outputs_equal_offline(server, offline, stream):
    for prompt in PROMPTS[:2]:
        want = offline(prompt)
        got = client.generate(server.grpc_url, prompt, MAX_TOKENS, stream=stream)
        assert got.text == want.text
        assert got.stats["num_output_tokens"] == want.num_new_tokens
        assert got.stats["num_input_tokens"] == want.stats["prompt_tokens"]
        assert got.stats["num_cached_tokens"] == want.stats["cached_tokens"] == 0  # (a speculative method: none)
        assert got.stats["acceptance_length"] == pytest.approx(want.stats["acceptance_length"], rel=1e-5)
        assert got.stats["mean_active_vocab"] == pytest.approx(want.stats["vocab_mean"], rel=1e-5)
        assert got.stats["mean_active_vocab"] > 0  # the draft really ran with a MicroSpec window
        assert len(got.pieces) > 1 if stream else len(got.pieces) == 1


def concurrently(calls: list) -> list:
    """Runs the calls at once, each on its own thread: their results, or the exception each raised."""
    results: list = [None] * len(calls)

    def run(i: int):
        try:
            results[i] = calls[i]()
        except Exception as e:  # recorded, so the assertion names it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


def gauges(server) -> dict[str, float]:
    """The model's batch metrics on Triton's metrics port (one instance)."""
    url = f"http://{server.host}:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as r:
        lines = r.read().decode().splitlines()
    return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("microspec_")}


def wait_idle(server, timeout: float = 30) -> dict[str, float]:
    """The gauges once nothing runs (the loop clears a finished batch one step after the last response)."""
    deadline = time.monotonic() + timeout
    while (g := gauges(server))["microspec_running_requests"] or g["microspec_kv_blocks_used"]:
        assert time.monotonic() < deadline, g
        time.sleep(0.1)
    return g


def test_sixteen_concurrent_streams(server, offline):
    """16 greedy streams decode together in the running batch (different prompts and budgets, joining as they
    arrive): each gets exactly the text it gets alone."""
    cases = [(PROMPTS[i % len(PROMPTS)], 12 if i < 8 else 6) for i in range(16)]
    results = concurrently([lambda p=p, m=m: client.generate(server.grpc_url, p, m, stream=True, timeout=300)
                            for p, m in cases])
    assert [getattr(r, "text", r) for r in results] == [offline(p, m).text for p, m in cases]
    g = wait_idle(server)
    assert g["microspec_waiting_requests"] == 0 and g["microspec_kv_blocks_total"] > 0
    # where the serving threads' time went (counters, brought up to date once a second while requests run)
    assert g["microspec_step_seconds"] > 0 and g["microspec_response_seconds"] > 0
    assert 0 < g["microspec_between_steps_seconds"] < g["microspec_step_seconds"]


def test_bad_and_sampled_requests_among_running_ones(server, offline):
    """While greedy streams run: a request the engine can never hold (its prompt over max_seq_len less a round's
    room; a budget past max_seq_len is no refusal: it stops at "length") gets its one-line error and the others finish; a sampling request joins the batch and gets the text of its seed
    alone."""
    sampling = {"temperature": 1.5, "top_p": 0.875, "top_k": 40, "random_seed": 7}
    want_sampled = offline.llm.generate(PROMPTS[3], MAX_TOKENS, temperature=1.5, top_p=0.875, top_k=40, seed=7).text
    calls = [lambda p=p: client.generate(server.grpc_url, p, MAX_TOKENS, stream=True, timeout=300) for p in PROMPTS]
    calls += [lambda: client.generate(server.grpc_url, "word " * (2 * MAX_SEQ_LEN), MAX_TOKENS, timeout=300),
              lambda: client.generate(server.grpc_url, PROMPTS[3], MAX_TOKENS, sampling=sampling, timeout=300)]
    *greedy, bad, sampled = concurrently(calls)
    assert [getattr(r, "text", r) for r in greedy] == [offline(p).text for p in PROMPTS]
    assert isinstance(bad, client.RequestError) and "accepts at most" in str(bad) and "\n" not in str(bad)
    assert getattr(sampled, "text", sampled) == want_sampled


def test_stop_words_and_end_id(server, offline):
    want = offline(PROMPTS[0]).text
    stop = want[len(want) // 2:][:3]  # a word from the middle of the output: the text ends right before it
    got = client.generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, stop_words=[stop])
    assert got.text == want[: want.index(stop)]
    # ended early, the request still reports the statistics of the rounds it ran
    assert got.stats["acceptance_length"] >= 1.0 and got.stats["mean_active_vocab"] > 0
    ids = offline(PROMPTS[0]).token_ids
    got = client.generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, end_id=ids[3])
    assert got.text == offline.llm.tokenizer.decode(ids[: ids.index(ids[3])])
    # a 1 MB stop word that never comes: the text held back at each step is found from the text's tail, not by
    # comparing each of the word's prefixes (which held the engine loop, and every request, for seconds a step: this
    # one took 250 s on 2 cores, a 300 KB one 40 s)
    plain = client.generate(server.grpc_url, PROMPTS[0], MAX_TOKENS)
    got = client.generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, stop_words=["never" * 200_000], timeout=60)
    assert got.text == want and got.latency_s < 5 * plain.latency_s + 10, (got.latency_s, plain.latency_s)


@pytest.mark.parametrize("param, value, message", [
    ("w_max", "0", "w_max must be between 8 and 49152"),
    ("depth", "two", "config.pbtxt parameter depth must be an integer, got 'two'"),
    ("max_batch", "0", "max_batch must be at least 1, got 0"),
    ("kv_memory", "lots", "config.pbtxt parameter kv_memory must be a number, got 'lots'"),
])
def test_bad_config_parameter_is_a_clear_error(args, tmp_path, param, value, message):
    """A hand-written repository (`serve --model-repository`) is checked by the model itself as it loads."""
    repo = write_repository(tmp_path, {**model_params(args), param: value})
    http, grpc, metrics = free_ports(3)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics) as s:
        with pytest.raises(UserError) as e:
            s.wait_ready(timeout=300)
    assert "before microspec was ready" in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def http_generate(server, body: dict, stream: bool = False) -> list[dict]:
    """POST to Triton's generate extension with a plain HTTP client: the JSON reply, or the server-sent events of
    generate_stream read as they arrive, as a list of JSON objects."""
    url = f"http://{server.host}:{server.http_port}/v2/models/microspec/generate{'_stream' if stream else ''}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            return [json.loads(r.read())]
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return [json.loads(line[len(b"data: "):]) for line in r if line.startswith(b"data: ")]


def test_http_generate(server, offline):
    want = offline(PROMPTS[0])
    (got,) = http_generate(server, {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert got["text_output"] == want.text
    assert got["num_output_tokens"] == want.num_new_tokens
    assert got["acceptance_length"] == pytest.approx(want.stats["acceptance_length"], rel=1e-5)


def test_http_generate_stream(server, offline):
    want = offline(PROMPTS[1])
    events = http_generate(server, {"text_input": PROMPTS[1], "max_tokens": MAX_TOKENS, "stream": True}, stream=True)
    assert len(events) > 2  # pieces as they were generated, then the statistics
    assert "".join(e["text_output"] for e in events) == want.text
    assert events[-1]["num_output_tokens"] == want.num_new_tokens and events[-1]["mean_active_vocab"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_http_bad_request_gets_a_clear_error(server, offline, stream):
    with pytest.raises(urllib.error.HTTPError) as e:
        http_generate(server, {"text_input": "Hi", "max_tokens": 0}, stream)
    assert e.value.code == 400
    error = json.loads(e.value.read().decode().removeprefix("data: "))["error"]  # generate_stream: as one event
    assert error.startswith("max_tokens must be between 1 and") and "\n" not in error
    (got,) = http_generate(server, {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert got["text_output"] == offline(PROMPTS[0]).text  # and it keeps serving


def raw_inputs(**tensors) -> list:
    """Hand-made inputs (name -> (values, numpy dtype, Triton dtype)) for the malformed cases."""
    out = []
    for name, (values, dtype, triton_type) in tensors.items():
        t = grpcclient.InferInput(name, [len(values)], triton_type)
        t.set_data_from_numpy(np.array(values, dtype=dtype))
        out.append(t)
    return out


MAX_TOKENS_IN = ([8], np.int32, "INT32")
BAD_REQUESTS = {
    "empty prompt": (client.make_inputs("", 8), "text_input is empty"),
    "missing text_input": (raw_inputs(max_tokens=MAX_TOKENS_IN), "text_input"),
    "wrong dtype": (raw_inputs(text_input=([1], np.int32, "INT32"), max_tokens=MAX_TOKENS_IN), "data-type"),
    "wrong shape": (raw_inputs(text_input=([b"a", b"b"], np.object_, "BYTES"), max_tokens=MAX_TOKENS_IN), "shape"),
    "max_tokens 0": (client.make_inputs("Hi", 0), "max_tokens must be between 1 and"),
    "max_tokens over the limit": (client.make_inputs("Hi", MAX_SEQ_LEN + 1), "max_tokens must be between 1 and"),
    "prompt too long": (client.make_inputs("hello " * MAX_SEQ_LEN, 8), "this engine accepts at most"),
    "undecodable bytes": (client.make_inputs(b"\xff\xfe caf\xc3", 8), "not valid UTF-8"),
    "negative temperature": (client.make_inputs("Hi", 8, sampling={"temperature": -0.5}), "temperature must be"),
    "top_p over 1": (client.make_inputs("Hi", 8, sampling={"top_p": 1.5}), "top_p must be in (0, 1]"),
    "negative top_k": (client.make_inputs("Hi", 8, sampling={"top_k": -1}), "top_k must be an integer >= 0"),
    "too many stop words": (client.make_inputs("Hi", 8, stop_words=["a"] * (client.MAX_STOP_WORDS + 1)),
                            f"stop_words: at most {client.MAX_STOP_WORDS} stop words per request, got 33"),
    "stop word not UTF-8": (raw_inputs(text_input=([b"Hi"], np.object_, "BYTES"), max_tokens=MAX_TOKENS_IN,
                                       stop_words=([b"\xff"], np.object_, "BYTES")), "stop_words is not valid UTF-8"),
}


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, offline):
    for case, (inputs, message) in BAD_REQUESTS.items():
        with pytest.raises(client.RequestError) as e:
            list(client.stream_infer(server.grpc_url, inputs, timeout=120))
        assert message in str(e.value), case
        assert "\n" not in str(e.value).strip(), case  # one line, no traceback
    assert client.generate(server.grpc_url, PROMPTS[1], MAX_TOKENS).text == offline(PROMPTS[1]).text


def test_sampled_request_equals_offline_with_the_same_seed(server, offline):
    """TensorRT-LLM's sampling inputs reach the engine: the server's sampled text is the offline one of the same
    seed (values exact in fp32, the inputs' type), and another seed gives another text."""
    inputs = {"temperature": 1.5, "top_p": 0.875, "top_k": 40, "random_seed": 7}
    want = offline.llm.generate(PROMPTS[3], MAX_TOKENS, temperature=1.5, top_p=0.875, top_k=40, seed=7)
    assert want.text != offline(PROMPTS[3]).text  # it really sampled
    assert client.generate(server.grpc_url, PROMPTS[3], MAX_TOKENS, sampling=inputs).text == want.text
    other = client.generate(server.grpc_url, PROMPTS[3], MAX_TOKENS, sampling={**inputs, "random_seed": 8})
    assert other.text != want.text


def test_a_request_may_ask_not_to_speculate(server, offline):
    """The speculate input (false): the request decodes as AR's -- the same text, no round (its acceptance and draft
    vocabulary null) -- beside one that speculates at the same time."""
    off, on = concurrently([
        lambda: client.generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, sampling={"speculate": False}),
        lambda: client.generate(server.grpc_url, PROMPTS[1], MAX_TOKENS)])
    assert off.text == offline(PROMPTS[0]).text and on.text == offline(PROMPTS[1]).text
    assert off.stats["acceptance_length"] is None and off.stats["mean_active_vocab"] is None
    assert on.stats["acceptance_length"] >= 1


LONG_PROMPT, LONG = "1, 2, 3, 4, 5, 6, 7, 8,", 100  # counting on: no early end of sequence
CLIENT_THEN_KILLED = f"""
import sys
from trtllm_microspec.serving import client
for piece in client.stream(sys.argv[1], {LONG_PROMPT!r}, {LONG}):
    print(piece, flush=True)
"""


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_abandoned_stream_frees_the_model(server, offline, how):
    assert offline(LONG_PROMPT, LONG).num_new_tokens == LONG  # so the abandoned request would run long
    if how == "cancel":
        gen = client.stream(server.grpc_url, LONG_PROMPT, LONG)
        next(gen), next(gen)
        running = gauges(server)
        gen.close()  # cancels the request on the server
    else:
        proc = subprocess.Popen([sys.executable, "-c", CLIENT_THEN_KILLED, server.grpc_url], stdout=subprocess.PIPE)
        proc.stdout.readline(), proc.stdout.readline()
        running = gauges(server)
        proc.kill()  # the client dies mid-stream: its connection drops
        proc.wait()
    assert running["microspec_running_requests"] == 1 and running["microspec_kv_blocks_used"] > 0
    got = client.generate(server.grpc_url, PROMPTS[2], MAX_TOKENS, timeout=300)
    assert got.text == offline(PROMPTS[2]).text
    # had the abandoned request run on, this one would have waited for ~LONG more tokens before its first
    per_token = (got.latency_s - got.ttft_s) / (got.stats["num_output_tokens"] - 1)
    assert got.ttft_s < LONG / 3 * per_token
    wait_idle(server)  # and its blocks went back


def test_serve_stops_on_sigterm_with_a_request_in_flight(engine_dir, random_draft_dir):
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "trtllm_microspec.cli", *serve_args(engine_dir, random_draft_dir),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--exit-timeout", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "ready" in proc.stdout.readline()
        url = f"127.0.0.1:{grpc}"
        assert url in proc.stdout.readline()  # the endpoints are printed
        errors = []
        gen = client.stream(url, LONG_PROMPT, LONG, timeout=120)
        next(gen)

        def drain():
            try:
                for _ in gen:
                    pass
            except client.RequestError as e:
                errors.append(str(e))

        reader = threading.Thread(target=drain)
        reader.start()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()  # it says so, and when it is done
        assert "microspec serve: SIGTERM, shutting down" in err and err.rstrip().endswith("microspec serve: stopped")
        reader.join(timeout=60)
        assert not reader.is_alive() and errors == ["the server is shutting down"]  # an error, not a hang
    finally:
        if proc.poll() is None:
            proc.kill()
    prefix = f"microspec_{proc.pid}_{grpc}_"  # TritonServer's shared-memory prefix, also in its stubs' command lines
    assert not list(Path("/dev/shm").glob(f"{prefix}*"))
    stubs = [p for p in Path("/proc").iterdir() if p.name.isdigit() and prefix.encode() in _cmdline(p)]
    assert not stubs


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def test_port_in_use(tmp_path):
    """A port another process listens on is refused before tritonserver starts (its readiness answers would
    otherwise come from the other server: seen on the H200 with two servers in a row)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        http, grpc, metrics = free_ports(2) + [busy.getsockname()[1]]
        with pytest.raises(UserError, match=f"port {metrics} on 127.0.0.1 is in use"):
            TritonServer(tmp_path, http_port=http, grpc_port=grpc, metrics_port=metrics)
