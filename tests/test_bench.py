"""`microspec bench`, the CPU smoke version: one question from three categories (MT-bench with its second turn,
translation, HumanEval), a few tokens, every main method plus one point of each sweep, on the real SmolLM2 engine
with a random draft head (losslessness must hold for any draft)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json

import pytest
import torch
from safetensors.torch import save_file

from trtllm_microspec.bench.specbench import data_dir, load_questions
from trtllm_microspec.cli import main
from trtllm_microspec.engine.loader import read_config
from trtllm_microspec.llm import FREQ_FILE

CATS = ["mt_bench", "translation", "code"]
SPEC = ["eagle", "frspec", "microspec", "frspec@K=1024", "microspec@W=512"]


@pytest.fixture(scope="module")
def bench(engine_dir, random_draft_dir, tmp_path_factory):
    # a copy of the shared engine (links) with a synthetic FR-Spec ranking, so the shared one is never touched
    eng = tmp_path_factory.mktemp("engine")
    for f in engine_dir.iterdir():
        if f.name != FREQ_FILE:
            (eng / f.name).symlink_to(f.resolve())
    V = read_config(engine_dir).vocab_size
    save_file({"ranked_ids": torch.randperm(V, generator=torch.Generator().manual_seed(0))}, eng / FREQ_FILE)
    out = tmp_path_factory.mktemp("bench")
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        main(["bench", "--engine", str(eng), "--draft", str(random_draft_dir), "--device", "cpu",
              "--categories", ",".join(CATS), "--limit", "1", "--max-new-tokens", "4", "--warmup", "1",
              "--methods", "ar,eagle,frspec,microspec,hf", "--frspec-k", "1024", "--w-max-sweep", "512,3072",
              "--depth", "2", "--total-tokens", "8", "--out", str(out)])
    return json.loads((out / "results.json").read_text()), out, log.getvalue()


def test_progress_names_each_stage(bench):
    _, _, log = bench
    assert "[bench] 3 questions (" in log and "7 runs: ar, eagle, frspec, microspec, frspec@K=1024, " in log
    lines = [line for line in log.splitlines() if line.startswith("[bench] ")]
    for label in ("ar", "eagle", "microspec@W=512"):
        for stage in ("loading the model", "1 warm-up requests", "question 1/3 (", "question 3/3 (", "tok/s"):
            assert any(f" {label}: " in line and stage in line for line in lines), (label, stage)


def test_every_method_and_category(bench):
    res, _, _ = bench
    hf = ["hf"] if importlib.util.find_spec("transformers") else []  # an optional dependency
    assert set(res["runs"]) == {"ar", *SPEC, *hf}  # W=3072 is the main microspec run, not run twice
    for name, run in res["runs"].items():
        assert set(run["summary"]) == {*CATS, "overall"}, name
        assert run["summary"]["mt_bench"]["turns"] == 2 and run["summary"]["overall"]["questions"] == 3
        assert all(s["new_tokens"] > 0 and s["speed"] > 0 for s in run["summary"].values())
    assert all(s["speedup"] == 1.0 for s in res["runs"]["ar"]["summary"].values())


def test_lossless_and_draft_stats(bench):
    res, _, _ = bench
    for name in SPEC:
        run = res["runs"][name]
        assert run["lossless"] and not run["mismatches"], name
        s = run["summary"]["overall"]
        assert s["acceptance_length"] >= 1.0 and 0 < s["draft_share"] < 1
        assert 0 <= s["coverage"] <= 1
    micro = res["runs"]["microspec@W=512"]["summary"]["overall"]
    assert micro["vocab_mean"] <= 512 + 1  # the window plus the pinned EOS
    assert res["runs"]["eagle"]["summary"]["overall"]["coverage"] == 1.0


def test_second_turn_sees_the_first_answer(bench):
    res, _, _ = bench
    t0, t1 = [r for r in res["runs"]["ar"]["turns"] if r["category"] == "mt_bench"]
    assert t1["prompt_tokens"] > t0["prompt_tokens"] + t0["new_tokens"]


def test_static_coverage_and_outputs(bench):
    res, out, _ = bench
    cov = res["static_coverage"]
    assert cov["k"][-1] == read_config(res["config"]["engine"]).vocab_size
    assert cov["overall"] == sorted(cov["overall"]) and cov["overall"][-1] == 1.0
    for png in ("fig6_wmax.png", "fig1b_coverage.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "| microspec@W=512 |" in md and "microspec sweep over w_max" in md


def test_questions():
    qs = load_questions(data_dir(None), ["mt_bench", "code"], 2)
    # MT-bench round-robin over its sub-categories: writing's first, then roleplay's first
    assert [q["qid"] for q in qs] == ["81", "91", "HumanEval/0", "HumanEval/1"]
    assert all(len(q["turns"]) == 2 for q in qs[:2])
    assert qs[2]["turns"][0].startswith("Complete the following Python function:\n```python\nfrom typing import List")


@pytest.mark.parametrize("args", [["--categories", "nope"], ["--methods", "ar,nope"], ["--data", "/nonexistent"]])
def test_bad_input(args, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--out", str(tmp_path), *args])
    assert e.value.code == 2 and "microspec: error:" in capsys.readouterr().err
