"""Tensor parallelism on the CPU: `mpirun -n 2 microspec generate --tp 2` (gloo, fp32) emits TP=1's tokens.

SmolLM2-135M has 9 heads and 3 KV heads, which do not split in 2 (refused in one line, tested below), so the
split is tested on a model cut from its real weights: its first 6 heads (the 2 KV heads they read) and its first
8 layers, with the shipped EAGLE head for the draft (it was trained on the whole model, so it is accepted less
often; the output must still be the target's). Gemma-3-270M (4 heads, 1 KV head) tests the replicated KV head,
Gemma's norms and a vocabulary of 262,144 split in two. A rank that stops answering ends the other with a
one-line error after --tp-timeout instead of a hang. `microspec serve --tp 2` (the Triton model as rank 0, one
follower) answers as TP=1 does, and a follower that dies stops it with one line.
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file

from trtllm_microspec import LLM, parallel
from trtllm_microspec.llm import resolve_engine
from trtllm_microspec.models.model import ModelConfig
from trtllm_microspec.models.registry import UserError

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="needs mpirun: pip install -e '.[tp]'")
PROMPT = "The capital of France is"  # no chat template: Gemma's engine has none
NEW_TOKENS = 12


def mpirun(n_or_apps, timeout: float = 600) -> subprocess.CompletedProcess:
    """`mpirun -n 2 ARGS` or, given several argument lists, one rank each (MPMD)."""
    apps = n_or_apps if isinstance(n_or_apps[0], list) else [n_or_apps]
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe"]
    for i, app in enumerate(apps):
        cmd += ([":"] if i else []) + ["-n", "1" if len(apps) > 1 else "2", *app]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def generate_args(engine, method: str, tp: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trtllm_microspec.cli", "generate", "--engine", str(engine), "--method", method,
            "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu", "--json",
            "--tp", str(tp), *extra]


@pytest.fixture(scope="module")
def split_engine(engine_dir, tmp_path_factory):
    """SmolLM2-135M cut to 6 heads (2 KV heads) and 8 layers: real weights that split over 2 ranks."""
    cfg = ModelConfig.load(engine_dir / "config.json")
    heads, kv, layers, d = 6, 2, 8, cfg.head_dim
    sd = load_file(engine_dir / "model.safetensors")
    out = {}
    for name, t in sd.items():
        if name.startswith("layers.") and int(name.split(".")[1]) >= layers:
            continue
        if ".q_proj." in name:
            t = t[: heads * d]
        elif ".k_proj." in name or ".v_proj." in name:
            t = t[: kv * d]
        elif ".o_proj." in name:
            t = t[:, : heads * d]
        out[name] = t.contiguous()
    d_out = tmp_path_factory.mktemp("split_engine")
    save_file(out, d_out / "model.safetensors")
    ModelConfig(**{**cfg.__dict__, "num_heads": heads, "num_kv_heads": kv, "num_layers": layers}).save(
        d_out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "eagle"):
        if (engine_dir / f).exists():
            (d_out / f).symlink_to(engine_dir / f)
    return d_out


def tp1_result(engine, method: str):
    # fixed: every step a round, so that the rounds' statistics can be compared (auto picks from timings)
    return LLM(engine, method, device="cpu", spec_policy="fixed").generate(PROMPT, NEW_TOKENS)


def tp2_result(engine, method: str) -> dict:
    r = mpirun(generate_args(engine, method, 2, "--spec-policy", "fixed"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, r.stdout  # only rank 0 prints
    return json.loads(lines[0])


@pytest.mark.parametrize("method", ["ar", "microspec"])
def test_tp2_equals_tp1(split_engine, method):
    got, want = tp2_result(split_engine, method), tp1_result(split_engine, method)
    assert got["token_ids"] == want.token_ids
    assert got["num_new_tokens"] == NEW_TOKENS or got["stats"]["stop_reason"] == "eos"
    if method == "microspec":  # the same windows (top-K_pre / top-K_ver combined over the ranks), the same rounds
        keys = ("rounds", "acceptance_length", "vocab_mean", "vocab_max", "coverage")
        assert {k: got["stats"][k] for k in keys} == {k: want.stats[k] for k in keys}
        assert got["stats"]["rounds"] > 0 and got["stats"]["vocab_mean"] > 0


def test_tp2_gemma_replicated_kv_head():
    engine = resolve_engine("gemma-3-270m")  # 4 heads, 1 KV head: each rank keeps a copy of it
    assert tp2_result(engine, "ar")["token_ids"] == tp1_result(engine, "ar").token_ids


def test_heads_that_do_not_split_are_refused(engine_dir, monkeypatch):
    monkeypatch.setattr(parallel, "_world", 2)  # the shard rule only; no process group is needed to refuse
    with pytest.raises(UserError, match=r"--tp 2 does not split this model: 9 heads, 3 KV heads"):
        parallel.shard_config(ModelConfig.load(engine_dir / "config.json"))


def test_wrong_rank_count_is_refused(split_engine):
    r = mpirun(generate_args(split_engine, "ar", 3))
    assert r.returncode != 0
    assert "microspec: error: --tp 3 needs 3 ranks, this job has 2: mpirun -n 3 microspec ..." in r.stderr


def test_a_rank_that_stops_answering_ends_the_others(split_engine):
    """Rank 1 joins the group, then never takes part in a collective: rank 0's first one (the prompt's
    embedding) times out after --tp-timeout and it ends with one line, and mpirun ends rank 1."""
    stall = [sys.executable, "-c", "import time, torch; from trtllm_microspec import parallel; "
             "parallel.init(2, torch.device('cpu'), 5); time.sleep(300)"]
    t0 = time.monotonic()
    r = mpirun([generate_args(split_engine, "ar", 2, "--tp-timeout", "5"), stall], timeout=240)
    assert r.returncode != 0
    assert time.monotonic() - t0 < 200
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("microspec: error:")]
    assert len(errors) == 1 and errors[0].startswith("microspec: error: rank 0 of 2: ") and "Timed out" in errors[0]


@pytest.fixture(scope="module")
def tp_server(split_engine):
    """`microspec serve --tp 2` on the CPU (gloo), small tree and cache so that it is quick."""
    pytest.importorskip("tritonclient")
    from trtllm_microspec.serving.server import pytriton_dir, stub_site
    try:
        pytriton_dir()
        stub_site(None)
    except UserError as e:
        pytest.skip(f"serve extra not installed: {e}")
    socks = [socket.socket() for _ in range(3)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    http, grpc, metrics = (sock.getsockname()[1] for sock in socks)
    for sock in socks:
        sock.close()
    cmd = [sys.executable, "-m", "trtllm_microspec.cli", "serve", "--tp", "2", *SERVE_KNOBS, "--engine",
           str(split_engine), "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "ready" in proc.stdout.readline(), proc.stderr.read()
        yield proc, f"127.0.0.1:{grpc}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


SERVE_KNOBS = ["--device", "cpu", "--max-seq-len", "256", "--depth", "3", "--tree-top-k", "8", "--total-tokens",
               "16"]


def test_serve_tp2_answers_as_tp1_and_stops_when_a_follower_dies(tp_server, split_engine):
    from trtllm_microspec.serving import client

    proc, url = tp_server
    offline = LLM(split_engine, "microspec", device="cpu", max_seq_len=256, depth=3, top_k=8, total_tokens=16)
    want = offline.generate("The capital of France is", 16)
    assert client.generate(url, "The capital of France is", 16, stream=True).text == want.text
    # a stop word ends the request early on rank 0: the follower ends it at the same step, so the next one agrees
    cut = client.generate(url, "The capital of France is", 16, stop_words=[want.text[6:10]])
    assert want.text.startswith(cut.text) and cut.stats["num_output_tokens"] < 16
    assert client.generate(url, "def fibonacci(n):", 12, stream=False).text == offline.generate(
        "def fibonacci(n):", 12).text
    follower = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "trtllm_microspec.serving.tp --rank 1"],
                              capture_output=True, text=True).stdout.split()
    assert len(follower) == 1
    subprocess.run(["kill", "-9", follower[0]], check=True)
    assert proc.wait(60) == 2
    assert proc.stderr.read().strip().splitlines()[-1].startswith(
        "microspec: error: tensor-parallel rank 1 exited with code -9")


def test_serve_gpus_writes_one_instance_per_gpu():
    from trtllm_microspec.serving.server import model_config, parse_gpus

    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0, 1 ] } ]" in model_config({}, "gpu",
                                                                                         gpus=parse_gpus("0,1", 1))
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in model_config({}, "cpu", gpus=parse_gpus(None, 1))
    for bad, tp in (("0,x", 1), ("1,1", 1), ("0,1", 2)):
        with pytest.raises(UserError, match="--gpus"):
            parse_gpus(bad, tp)
