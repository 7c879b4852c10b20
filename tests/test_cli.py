"""The `microspec` command line: listing, JSON generation, and one-line errors (exit 2, no traceback) for bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trtllm_microspec.cli import main
from trtllm_microspec.models.registry import MODELS


def run(capsys, *argv):
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(result, *words):
    code, _, err = result
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("microspec: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def engine(engine_dir, tmp_path_factory):
    """A copy of the engine (files linked) that surely has no default draft head in <engine>/eagle."""
    out = tmp_path_factory.mktemp("engine")
    for f in engine_dir.iterdir():
        if f.is_file():
            (out / f.name).symlink_to(f)
    return out


def gen(engine, *extra):
    return ["generate", "--engine", engine, "--device", "cpu", *extra]


def test_models_list(capsys):
    code, out, _ = run(capsys, "models", "list")
    assert code == 0
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(MODELS)


def test_fetch_bad_key(capsys):
    assert_user_error(run(capsys, "models", "fetch", "bad-key"), "bad-key", *MODELS)


def test_fetch_bad_key_subprocess():
    """The same through a real process: exit status 2 and one line on stderr."""
    r = subprocess.run([sys.executable, "-m", "trtllm_microspec.cli", "models", "fetch", "bad-key"],
                       capture_output=True, text=True)
    assert_user_error((r.returncode, r.stdout, r.stderr), "valid keys")


def test_ctrl_c_is_one_line(engine):
    """SIGINT while generate streams: exit 130 and one line, no traceback."""
    import signal

    argv = gen(engine, "--prompt", "Write a long story about a dragon.", "--chat", "--max-new-tokens", 2000)
    # Ctrl-C's default disposition in the child, as a terminal gives it: a test run started as a background job
    # (`cmd &` in a script) ignores SIGINT, and so would every child it starts (/proc/PID/status SigIgn), which
    # never ended on four SIGINTs
    p = subprocess.Popen([sys.executable, "-m", "trtllm_microspec.cli", *map(str, argv)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        p.stdout.read(1)  # the first piece of the stream: the model is loaded and decoding
        for _ in range(4):  # (a few times, in case one lands before Python's handler is in place)
            p.send_signal(signal.SIGINT)
            try:
                _, err = p.communicate(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            pytest.fail("generate did not end on four SIGINTs in 60 s")
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "microspec: interrupted", err


def test_generate_json(capsys, engine, random_draft_dir):
    code, out, err = run(capsys, *gen(engine, "--prompt", "What is the capital of France?", "--chat",
                                      "--max-new-tokens", "6", "--json"))
    assert code == 0, err
    (line,) = out.strip().splitlines()
    r = json.loads(line)
    assert {"text", "token_ids", "num_new_tokens", "wall_s", "tokens_per_s", "stats"} <= r.keys()
    assert r["num_new_tokens"] == len(r["token_ids"]) == r["stats"]["new_tokens"] > 0
    assert r["text"].strip() and r["wall_s"] > 0 and r["tokens_per_s"] > 0
    assert r["stats"]["method"] == "ar"
    # a speculative method prints the same tokens, with its own stats
    code, out, err = run(capsys, *gen(engine, "--prompt", "What is the capital of France?", "--chat",
                                      "--max-new-tokens", "6", "--json", "--method", "microspec",
                                      "--draft", random_draft_dir, "--depth", "2", "--total-tokens", "8",
                                      "--spec-policy", "fixed"))  # every step a round (auto may pick plain rows)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["token_ids"] == r["token_ids"] and spec["text"] == r["text"]
    assert spec["stats"]["method"] == "microspec" and spec["stats"]["rounds"] > 0


def test_generate_streams_text(capsys, engine):
    code, out, err = run(capsys, *gen(engine, "--prompt", "What is the capital of France?", "--chat",
                                      "--max-new-tokens", "6"))
    assert code == 0
    assert "Paris" in out
    assert "tokens in" in err  # the summary line goes to stderr


def test_empty_prompt(capsys, engine):
    assert_user_error(run(capsys, *gen(engine, "--prompt", "")), "empty")


def test_prompt_too_long(capsys, engine):
    assert_user_error(run(capsys, *gen(engine, "--prompt", "word " * 100, "--max-seq-len", "64")),
                      "at most", "max_seq_len 64")


def test_max_new_tokens_zero(capsys, engine):
    assert_user_error(run(capsys, *gen(engine, "--prompt", "hi", "--max-new-tokens", "0")), "max_new_tokens")


def test_missing_engine_dir(capsys, tmp_path):
    assert_user_error(run(capsys, *gen(tmp_path / "nope", "--prompt", "hi")), "nope")


def test_engine_dir_without_config(capsys, tmp_path):
    assert_user_error(run(capsys, *gen(tmp_path, "--prompt", "hi")), "config.json")


def test_wrong_model_name(capsys):
    assert_user_error(run(capsys, *gen("llama-70b", "--prompt", "hi")), "llama-70b", "smollm2-135m")
    assert_user_error(run(capsys, "build", "llama-70b", "--out", "x"), "llama-70b")


def test_method_needs_draft(capsys, engine):
    assert_user_error(run(capsys, *gen(engine, "--prompt", "hi", "--method", "microspec")), "draft")


def test_draft_dir_not_a_draft(capsys, engine, tmp_path):
    (tmp_path / "notes.txt").write_text("not a draft")
    assert_user_error(run(capsys, *gen(engine, "--prompt", "hi", "--method", "eagle", "--draft", tmp_path)),
                      "not a draft")


def test_draft_hidden_size_mismatch(capsys, engine, random_draft_dir, tmp_path):
    bad = tmp_path / "draft"
    shutil.copytree(random_draft_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 1024
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_user_error(run(capsys, *gen(engine, "--prompt", "hi", "--method", "eagle", "--draft", bad)),
                      "1024", "576")


@pytest.mark.parametrize("script, argv", [
    ("build_engine.py", ["{tmp}/missing.gguf", "--out", "{tmp}/engine"]),
    ("build_draft.py", ["--checkpoint", "{tmp}", "--engine", "{tmp}", "--out", "{tmp}/draft"]),
])
def test_build_scripts_are_the_cli(script, argv, tmp_path):
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "build_scripts" / script), *(a.format(tmp=tmp_path) for a in argv)],
                       capture_output=True, text=True)
    assert_user_error((r.returncode, r.stdout, r.stderr))


# Every numeric knob of add_llm_args and add_batch_args, out of range: (flag, value, what the one-line error must say). The checks run
# before any weights load, in generate as in serve (where they run before tritonserver starts).
BAD_KNOBS = [
    ("--w-max", 0, "w_max must be between 4 and 49152"),
    ("--w-max", -3, "w_max must be between 4 and 49152"),
    ("--w-max", 3, "the window holds at least the tree's top_k ids"),
    ("--w-max", 49153, "w_max must be between 4 and 49152"),
    ("--k-pre", -1, "k_pre must be between 0 and 49152 (0: the window starts from the prompt's own tokens"),
    ("--k-pre", 49153, "k_pre must be between 0 and 49152"),
    ("--k-ver", -1, "k_ver must be between 0 and 49152 (0: rounds add only the draft tree's tokens"),
    ("--static-k", 0, "static_k must be between 4 and 49152"),
    ("--depth", 0, "depth must be at least 1, got 0"),
    ("--depth", -2, "depth must be at least 1, got -2"),
    ("--tree-top-k", 0, "the tree's top_k must be between 1 and 49152"),
    ("--tree-top-k", 49153, "the tree's top_k must be between 1 and 49152"),
    ("--total-tokens", 0, "total_tokens must be between 2 and 53 (the root plus up to 52 draft tokens"),
    ("--total-tokens", 1, "total_tokens must be between 2 and 53"),
    ("--total-tokens", 54, "total_tokens must be between 2 and 53"),
    ("--max-seq-len", 0, "max_seq_len must be at least 1, got 0"),
    ("--max-seq-len", -5, "max_seq_len must be at least 1, got -5"),
    ("--tp", 0, "tp must be at least 1, got 0"),
    ("--tp-timeout", 0, "tp_timeout must be positive (seconds), got 0.0"),
    ("--tp-timeout", "nan", "tp_timeout must be positive (seconds), got nan"),
    ("--tp-timeout", "inf", "tp_timeout must be positive (seconds), got inf"),
    ("--max-batch", 0, "max_batch must be at least 1, got 0"),
    ("--max-num-tokens", 0, "max_num_tokens must be at least 1, got 0"),
    ("--kv-memory", 0, "kv_memory must be positive (a fraction of free GPU memory, or GiB), got 0.0"),
    ("--kv-memory", "nan", "kv_memory must be positive (a fraction of free GPU memory, or GiB), got nan"),
    ("--kv-memory", "inf", "kv_memory must be positive (a fraction of free GPU memory, or GiB), got inf"),
    ("--temperature", -1, "temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    ("--temperature", "nan", "temperature must be a finite number >= 0"),
    ("--temperature", "1e300", "temperature must be at most 3.403e+38, got 1e+300"),  # over a float32
    ("--top-p", 0, "top_p must be in (0, 1], got 0.0"),
    ("--top-p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("--top-k", -1, "top_k must be an integer >= 0 (0 = no limit), got -1"),
    ("--seed", -1, "seed must be an integer in [0, 2^64), got -1"),
]
SAMPLING = ("--temperature", "--top-p", "--top-k", "--seed")  # generate's (and bench's), not serve's


def serve_available() -> bool:
    from trtllm_microspec.models.registry import UserError
    from trtllm_microspec.serving.server import pytriton_dir

    try:
        pytriton_dir()
        return True
    except UserError:
        return False


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("flag, value, message", BAD_KNOBS)
def test_bad_knob_is_one_line_error(capsys, engine, random_draft_dir, command, flag, value, message):
    if command == "serve" and not serve_available():
        pytest.skip("serve extra not installed")
    if command == "serve" and flag in SAMPLING:
        pytest.skip("sampling is per request in serve: its inputs are checked in test_sampling / test_serving")
    argv = [command, "--engine", engine, "--draft", random_draft_dir, "--device", "cpu", "--method", "microspec",
            flag, value]
    if command == "generate":
        argv += ["--prompt", "hi"]
    assert_user_error(run(capsys, *argv), message)


def test_bad_knob_beside_a_dead_servers_leftovers(capsys, engine, random_draft_dir):
    # a killed server's folder waits for the next start to reap it; bad input still fails in one line, first
    if not serve_available():
        pytest.skip("serve extra not installed")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = Path(tempfile.gettempdir()) / f"microspec-serve-{dead.pid}-test"
    left.mkdir()
    try:
        assert_user_error(run(capsys, "serve", "--engine", engine, "--draft", random_draft_dir, "--device", "cpu",
                              "--w-max", 0), "w_max must be between")
        assert left.exists()  # reaped only by a start that got past the checks
    finally:
        shutil.rmtree(left, ignore_errors=True)


def test_tree_too_big_for_max_seq_len(capsys, engine, random_draft_dir):
    # each round reserves 60 cache slots for the GPU's tree: 40 leaves no room for a prompt
    assert_user_error(run(capsys, *gen(engine, "--prompt", "hi", "--method", "microspec", "--draft", random_draft_dir,
                                       "--depth", 5, "--tree-top-k", 10, "--total-tokens", 60, "--max-seq-len", 40)),
                      "max_seq_len 40 leaves no room", "60 cache slots")


def test_tree_fits_the_device(capsys, engine, random_draft_dir):
    """Tree knobs left unset take the device's tree (a 60-token verify costs a CPU several decode steps); each one
    given wins; LLM(...) and the commands decide in the same function."""
    from trtllm_microspec import LLM
    from trtllm_microspec.speculative.tree import CPU_TREE, TreeConfig, tree_for

    assert tree_for("cpu") == CPU_TREE == TreeConfig(depth=3, top_k=4, total_tokens=12)
    assert tree_for("cuda") == TreeConfig(depth=5, top_k=10, total_tokens=60)
    assert tree_for("cpu", depth=5) == TreeConfig(5, 4, 12)
    assert tree_for("cuda:1", total_tokens=30) == TreeConfig(5, 10, 30)
    assert LLM(engine, "microspec", draft=random_draft_dir, device="cpu").tree == CPU_TREE
    assert LLM(engine, "microspec", draft=random_draft_dir, device="cpu", depth=2, top_k=3,
               total_tokens=8).tree == TreeConfig(2, 3, 8)
    code, out, _ = run(capsys, "generate", "--help")
    assert code == 0 and "default: 12 on a CPU, 60 on a GPU" in " ".join(out.split())


def test_bad_device(capsys, engine):
    assert_user_error(run(capsys, *gen(engine, "--prompt", "hi", "--device", "tpu")), "unknown device 'tpu'")


def test_k_pre_and_k_ver_zero(capsys, engine, random_draft_dir):
    """0 is allowed and means: the window starts from the prompt's tokens only, and rounds add only the tree's
    (k_tree 0 too; the paper's window: microspec's fill would top both up to W_max)."""
    def vocab_and_ids(*knobs):
        code, out, err = run(capsys, *gen(engine, "--prompt", "The capital of France is", "--max-new-tokens", 8,
                                          "--json", "--method", "microspec-paper", "--draft", random_draft_dir,
                                          "--depth", 2, "--tree-top-k", 4, "--total-tokens", 8, "--spec-policy",
                                          "fixed", *knobs))  # rounds, whose window is measured (auto: timing's pick)
        assert code == 0, err
        r = json.loads(out)
        return r["stats"]["vocab_mean"], r["token_ids"]

    vocab, ids = vocab_and_ids()
    vocab0, ids0 = vocab_and_ids("--k-pre", 0, "--k-ver", 0, "--k-tree", 0)
    assert ids0 == ids  # still lossless
    assert 0 < vocab0 < vocab  # fewer candidates entered the window


def damaged_copy(engine_dir: Path, out: Path) -> Path:
    """A copy of the engine whose files are links, so a test can replace one file without touching the real one."""
    out.mkdir(parents=True)
    for f in engine_dir.iterdir():
        if f.is_file():
            (out / f.name).symlink_to(f)
    return out


def cut_weights(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))


DAMAGES = {
    "weights cut short": (cut_weights, "weights: Error while deserializing header"),
    "tokenizer missing": (lambda d: (d / "tokenizer.json").unlink(), "missing tokenizer.json"),
    "config not matching the weights": (lambda d: edit_config(d, hidden_size=640), "size mismatch"),
    "config cut short": (lambda d: (d / "config.json").unlink() or (d / "config.json").write_text('{"arch": '),
                         "config.json: Expecting value"),
}


@pytest.mark.parametrize("case", DAMAGES)
def test_damaged_engine_dir(capsys, engine_dir, tmp_path, case):
    damage, reason = DAMAGES[case]
    d = damaged_copy(engine_dir, tmp_path / "engine")
    damage(d)
    assert_user_error(run(capsys, *gen(d, "--prompt", "hi")), f"{d} is damaged (", reason,
                      f"rebuild it with `microspec build smollm2-135m --out {d} --force`")


def test_damaged_cached_engine_is_rebuilt_with_force(capsys, engine_dir, tmp_path, monkeypatch):
    """A cached engine named by its model key: the message gives the command that repairs it, and it does."""
    monkeypatch.setenv("MICROSPEC_CACHE", str(tmp_path))
    gguf = tmp_path / "models" / "smollm2-135m" / "smollm2-135m.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.symlink_to(Path(json.loads((engine_dir / "source.json").read_text())["path"]))  # no second download
    cached = damaged_copy(engine_dir, tmp_path / "engines" / "smollm2-135m")
    cut_weights(cached)
    argv = gen("smollm2-135m", "--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", 6)
    assert_user_error(run(capsys, *argv), "is damaged (", "rebuild it with `microspec build smollm2-135m --force`")
    code, out, err = run(capsys, "build", "smollm2-135m")  # without --force an engine that is there is kept
    assert code == 0 and "already built; --force rebuilds it" in err
    assert_user_error(run(capsys, *argv), "is damaged (")
    code, out, err = run(capsys, "build", "smollm2-135m", "--force")
    assert code == 0, err
    code, out, err = run(capsys, *argv)
    assert code == 0 and "Paris" in out, err


def test_build_max_seq_len(capsys, tmp_path):
    assert_user_error(run(capsys, "build", "smollm2-135m", "--out", tmp_path / "e", "--max-seq-len", 0),
                      "max_seq_len must be at least 1, got 0")


def test_help_is_for_users(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "microspec quickstart" in out and "register(" not in out
    code, out, _ = run(capsys, "generate", "--help")
    options = " ".join(out.split("options:")[1].split())  # argparse wraps lines
    for flag in ("--w-max", "--k-pre", "--k-ver", "--static-k", "--depth", "--tree-top-k", "--total-tokens",
                 "--max-seq-len", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed"):
        explained = options.split(f"{flag} {flag[2:].upper().replace('-', '_')} ", 1)[1].split(" --", 1)[0]
        assert len(explained.split()) >= 6, (flag, explained)


def test_every_default_is_in_help(capsys):
    """Every option that has a default (not unset, not an off flag) shows it in its command's --help."""
    import argparse

    from trtllm_microspec.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            d = action.default
            if not action.option_strings or d is None or d is False or d is argparse.SUPPRESS:
                continue
            explained = " ".join(parser._get_formatter()._format_action(action).split())  # as --help shows it
            assert "default" in explained, (name, explained)
            assert str(d if not isinstance(d, list) else ",".join(map(str, d))) in explained or "default:" in explained
    assert "serve" in sub.choices and "Greedy text generation" not in build_parser().format_help()


def long_prompt_message(method: str) -> str:
    """The one message for a prompt over the limit: the engine's max_seq_len (64 here) less one step's room."""
    room = ("18 cache slots of room for one speculative round (its draft tree)" if method == "microspec" else
            "2 cache slots of room for one decode step")
    return (f"tokens; this engine accepts at most {64 - int(room.split()[0])}: max_seq_len 64 less {room} and the "
            "next token")


def api_error(fn) -> tuple[int, str, str]:
    from trtllm_microspec.models.registry import UserError

    try:
        fn()
    except UserError as e:
        return 2, "", f"microspec: error: {e}\n"
    return 0, "", ""


LONG = "hello " * 80  # over 64 tokens


# (case, how to produce it from (capsys, engine, draft, tmp_path) -> (exit code, stdout, stderr), words of its one line)
MESSAGES = [
    ("a JSON prompts file with a number",
     lambda c, e, d, t: run(c, *gen(e, "--prompts-file", write(t / "p.json", '["ok", 7]'))),
     ["p.json: prompt 1 (counting from 0) is a number 7, not a non-empty string"]),
    ("a JSON prompts file with an object",
     lambda c, e, d, t: run(c, *gen(e, "--prompts-file", write(t / "p.json", '["ok", "fine", {"role": "user"}]'))),
     ['prompt 2 (counting from 0) is an object {"role": "user"}, not a non-empty string']),
    ("a JSON prompts file with an empty string",
     lambda c, e, d, t: run(c, *gen(e, "--prompts-file", write(t / "p.json", '[""]'))),
     ["prompt 0 (counting from 0) is an empty string"]),
    ("an engine whose config.json is {}",
     lambda c, e, d, t: run(c, *gen(config_copy(e, t, "{}"), "--prompt", "hi")),
     ["is damaged (config.json: no arch, vocab_size, hidden_size, intermediate_size, num_layers, num_heads, "
      "num_kv_heads, head_dim, rms_norm_eps, rope_theta, max_seq_len, tie_word_embeddings): rebuild it with"]),
    ("an engine whose config.json is a list",
     lambda c, e, d, t: run(c, *gen(config_copy(e, t, "[1]"), "--prompt", "hi")),
     ["config.json: a JSON list, not an object of model settings"]),
    ("a prompts file that is not text",
     lambda c, e, d, t: run(c, *gen(e, "--prompts-file", write_bytes(t / "p.txt", bytes(range(256))))),
     ["p.txt is not UTF-8 text (byte 128): give prompts one per line, or a JSON list of strings"]),
    ("a prompts file of blank lines (spaces)",
     lambda c, e, d, t: run(c, *gen(e, "--prompts-file", write(t / "p.txt", "  \n\n \t\n"))), ["holds no prompts"]),
    ("a KV pool larger than the machine",
     lambda c, e, d, t: run(c, *gen(e, "--prompt", "hi", "--kv-memory", 1e6)),
     ["the KV-cache pool (--kv-memory, in GiB here) needs 1e+06 GiB; the cpu has"]),
    ("a max_batch whose block table is larger than the machine",
     lambda c, e, d, t: run(c, *gen(e, "--prompt", "hi", "--max-batch", 10 ** 12)),
     ["the block table of max_batch 1000000000000 needs", "GiB; the cpu has"]),
    ("a CPU device with an index", lambda c, e, d, t: run(c, *gen(e, "--prompt", "hi", "--device", "cpu:7")),
     ["unknown device 'cpu:7'; use cpu, cuda or cuda:N"]),
    ("a torch device type that is not cpu or cuda",
     lambda c, e, d, t: run(c, *gen(e, "--prompt", "hi", "--device", "meta")), ["unknown device 'meta'"]),
    ("build --out an existing file",
     lambda c, e, d, t: run(c, "build", "smollm2-135m", "--out", write(t / "f", "x")),
     ["--out", "is a file, not a directory"]),
    ("build --max-seq-len past the model's context",
     lambda c, e, d, t: last_line(run(c, "build", "smollm2-135m", "--out", t / "e", "--max-seq-len", 10 ** 12)),
     ["max_seq_len 1000000000000 is more than the model's context of 8192 tokens"]),
    ("build-freq --limit 0", lambda c, e, d, t: run(c, "build-freq", "--engine", e, "--limit", 0),
     ["--limit must be at least 1, got 0"]),
    ("build-freq of an empty corpus",
     lambda c, e, d, t: run(c, "build-freq", "--engine", e, "--corpus", write(t / "c.txt", "")),
     ["c.txt holds no text to count; token_freq.safetensors is left as it was"]),
    ("build-freq of a corpus that is not text",
     lambda c, e, d, t: run(c, "build-freq", "--engine", e, "--corpus", write_bytes(t / "c.txt", bytes(range(256)))),
     ["c.txt is not UTF-8 text (byte 128)"]),
    ("build-freq of a .jsonl corpus with a line that is not JSON",
     lambda c, e, d, t: run(c, "build-freq", "--engine", e, "--corpus", write(t / "c.jsonl", '{"text": "a"}\n{"te')),
     ["c.jsonl:2: not a JSON line ("]),
    ("bench --categories with no name",
     lambda c, e, d, t: run(c, "bench", "--engine", e, "--device", "cpu", "--categories", ",", "--out", t / "b"),
     ["--categories is empty; choose from mt_bench"]),
    ("bench --warmup -1", lambda c, e, d, t: run(c, "bench", "--engine", e, "--device", "cpu", "--warmup", -1),
     ["--warmup must be at least 0, got -1"]),
    ("bench --out under a file",
     lambda c, e, d, t: run(c, "bench", "--engine", e, "--device", "cpu", "--out", write(t / "f", "x") / "sub"),
     ["/f/sub:", "/f is a file, not a directory"]),
    ("distill --conversations 0",
     lambda c, e, d, t: run(c, "distill", "--engine", e, "--out", t / "o", "--conversations", 0),
     ["--conversations must be at least 1, got 0"]),
    ("distill --time-limit nan",
     lambda c, e, d, t: run(c, "distill", "--engine", e, "--out", t / "o", "--time-limit", "nan"),
     ["--time-limit must be positive, got nan"]),
    ("distill --out a file", lambda c, e, d, t: run(c, "distill", "--engine", e, "--out", write(t / "f", "x")),
     ["is a file, not a directory"]),
    ("distill --prompts a file with a line that is not JSON",
     lambda c, e, d, t: run(c, "distill", "--engine", e, "--out", t / "o", "--prompts", write(t / "p.jsonl", '"a"\n{')),
     ["p.jsonl:2: not a JSON line ("]),
    ("train-draft --distill-prompts with nothing to distill",
     lambda c, e, d, t: run(c, "train-draft", "--engine", e, "--out", t / "o", "--distill-time", 0,
                            "--distill-prompts", write(t / "p.jsonl", '"a"\n')),
     ["--distill-prompts is what distilling answers: it goes with --distill-time N"]),
    ("train-draft --lr nan", lambda c, e, d, t: run(c, "train-draft", "--engine", e, "--out", t / "o", "--lr", "nan"),
     ["--lr must be positive, got nan"]),
    ("train-draft --heldout nan",
     lambda c, e, d, t: run(c, "train-draft", "--engine", e, "--out", t / "o", "--heldout", "nan"),
     ["--heldout must be a fraction in [0, 1), got nan"]),
    ("train-draft --max-len 1",
     lambda c, e, d, t: run(c, "train-draft", "--engine", e, "--out", t / "o", "--max-len", 1),
     ["--max-len must be at least 2, got 1"]),
    ("train-draft --distill-time nan",
     lambda c, e, d, t: run(c, "train-draft", "--engine", e, "--out", t / "o", "--distill-time", "nan"),
     ["--distill-time must be at least 0, got nan"]),
    ("train-draft --out a file",
     lambda c, e, d, t: run(c, "train-draft", "--engine", e, "--out", write(t / "f", "x"), "--distill-time", 0),
     ["is a file, not a directory"]),
    ("client --requests -1", lambda c, e, d, t: run(c, "client", "--prompt", "hi", "--requests", -1),
     ["--requests must be at least 0, got -1"]),
    ("a long prompt, ar, --prompt",
     lambda c, e, d, t: run(c, *gen(e, "--prompt", LONG, "--max-seq-len", 64)), [long_prompt_message("ar")]),
    ("a long prompt, ar, --prompts-file",
     lambda c, e, d, t: run(c, *gen(e, "--prompts-file", write(t / "p.txt", f"hi\n{LONG}\n"), "--max-seq-len", 64,
                                    "--max-new-tokens", 8)),
     [long_prompt_message("ar")]),
    ("a long prompt, microspec, --prompt",
     lambda c, e, d, t: run(c, *gen(e, "--prompt", LONG, "--max-seq-len", 64, "--method", "microspec", "--draft", d)),
     [long_prompt_message("microspec")]),
    ("a long prompt, microspec, --prompts-file",
     lambda c, e, d, t: run(c, *gen(e, "--prompts-file", write(t / "p.txt", f"{LONG}\n"), "--max-seq-len", 64,
                                    "--method", "microspec", "--draft", d)), [long_prompt_message("microspec")]),
    ("a long prompt, microspec, LLM.generate",
     lambda c, e, d, t: api_error(lambda: llm(e, d).generate(LONG)), [long_prompt_message("microspec")]),
    ("a long prompt, microspec, LLM.generate of a list",
     lambda c, e, d, t: api_error(lambda: llm(e, d).generate(["hi", LONG])), [long_prompt_message("microspec")]),
    ("a long prompt, microspec, LLM.stream",
     lambda c, e, d, t: api_error(lambda: list(llm(e, d).stream(LONG))), [long_prompt_message("microspec")]),
]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def last_line(result):
    """build prints its progress (loading the source) before the error that needs the loaded config."""
    code, out, err = result
    return code, out, err.strip().splitlines()[-1]


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def config_copy(engine_dir: Path, tmp_path: Path, text: str) -> Path:
    d = damaged_copy(engine_dir, tmp_path / "engine")
    (d / "config.json").unlink()
    (d / "config.json").write_text(text)
    return d


_llms: dict = {}


def llm(engine, draft):
    from trtllm_microspec import LLM

    if "microspec" not in _llms:  # one model for the API rows
        _llms["microspec"] = LLM(engine, "microspec", draft=draft, device="cpu", max_seq_len=64)
    return _llms["microspec"]


@pytest.mark.parametrize("case, produce, words", MESSAGES, ids=[m[0] for m in MESSAGES])
def test_message(capsys, engine, random_draft_dir, tmp_path, case, produce, words):
    assert_user_error(produce(capsys, engine, random_draft_dir, tmp_path), *words)


def test_prompts_file_requests_have_their_phase_times(capsys, engine, random_draft_dir, tmp_path):
    """The engine times the steps each request took part in: prefill and decode; a round runs its phases as one
    launch, so they are not split (None), a request alone (a batch of one) as a batch."""
    for method in ("ar", "microspec"):
        prompts = write(tmp_path / "p.txt", "Hi\nWhy is the sky blue?\n")
        code, out, err = run(capsys, *gen(engine, "--prompts-file", prompts, "--max-new-tokens", 6, "--json",
                                          "--method", method, "--draft", random_draft_dir))
        assert code == 0, err
        results = [json.loads(line) for line in out.strip().splitlines()]
        assert len(results) == 2 and results[0]["num_new_tokens"] == 6
        for r in results:
            s = r["stats"]
            assert s["prefill_s"] > 0 and s["decode_s"] + s["prefill_s"] <= s["wall_s"]
            assert (s["decode_s"] > 0) == (r["num_new_tokens"] > 1)  # the first token comes from the prefill
            assert s["draft_s"] is None and s["verify_s"] is None and s["update_s"] is None
    code, out, err = run(capsys, *gen(engine, "--prompt", "Hi", "--max-new-tokens", 6, "--json", "--method",
                                      "microspec", "--draft", random_draft_dir))
    s = json.loads(out)["stats"]
    assert code == 0 and s["draft_s"] is None and s["decode_s"] > 0 and s["prefill_s"] > 0


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench"], ["profile"]])
def test_overlap_flag(command):
    """--overlap / --no-overlap on every command that runs the batched engine; unset: the engine's default (on)."""
    from trtllm_microspec.cli import build_parser
    from trtllm_microspec.engine.scheduler import DEFAULT_OVERLAP

    parse = build_parser().parse_args
    assert parse(command).overlap is None and DEFAULT_OVERLAP is True
    assert parse(command + ["--overlap"]).overlap is True and parse(command + ["--no-overlap"]).overlap is False
