"""The `microspec` command line: listing, JSON generation, and one-line errors (exit 2, no traceback) for bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
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
                                      "--draft", random_draft_dir, "--depth", "2", "--total-tokens", "8"))
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
