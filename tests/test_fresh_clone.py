"""A clone with nothing beside it: the evaluation data (Spec-Bench, HumanEval) ships inside the package, and
`microspec bench` and `train-draft --eval` find it with no --data and no MICROSPEC_DATA. The package is copied into
a temporary directory that holds nothing else and run from there, so no folder next to this checkout can be read."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import trtllm_microspec
from trtllm_microspec.bench.specbench import PACKAGED_DATA, data_dir, load_questions
from trtllm_microspec.models.registry import cache_dir

REPO = Path(trtllm_microspec.__file__).resolve().parents[1]


def test_default_data_is_inside_the_package(monkeypatch):
    monkeypatch.delenv("MICROSPEC_DATA", raising=False)
    package = Path(trtllm_microspec.__file__).resolve().parent
    d = data_dir(None)
    assert d == PACKAGED_DATA and d.is_relative_to(package)
    for f in ("spec_bench/question.jsonl", "spec_bench/LICENSE", "humaneval/HumanEval.jsonl.gz", "humaneval/LICENSE"):
        assert (d / f).is_file(), f
    qs = load_questions(d, ["qa", "code"], None)
    assert sum(q["category"] == "qa" for q in qs) == 80 and sum(q["category"] == "code" for q in qs) == 164


@pytest.fixture(scope="module")
def lone_clone(tmp_path_factory):
    """<tmp>/clone holding only the package's code and data; <tmp> holds nothing else, so <clone>/.. is empty."""
    root = tmp_path_factory.mktemp("alone")
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    for d in ("trtllm_microspec", "plugins", "build_scripts"):
        shutil.copytree(REPO / d, root / "clone" / d, ignore=ignore)
    (root / "work").mkdir(parents=True)
    assert sorted(p.name for p in root.iterdir()) == ["clone", "work"]
    env = {k: v for k, v in os.environ.items() if k not in ("MICROSPEC_DATA", "PYTHONPATH")}
    env.update(PYTHONPATH=str(root / "clone"), MICROSPEC_CACHE=str(cache_dir()), OMP_NUM_THREADS="1")
    return root, env


def run(lone_clone, code: str) -> str:
    root, env = lone_clone
    r = subprocess.run([sys.executable, "-c", code], cwd=root / "work", env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_bench_finds_the_packaged_data(lone_clone, engine_dir):
    out = lone_clone[0] / "work" / "bench"
    clone = str(lone_clone[0] / "clone")
    run(lone_clone, f"import trtllm_microspec; assert trtllm_microspec.__file__.startswith({clone!r}); "
        "from trtllm_microspec.cli import main; main(['bench', '--engine', "
        f"{str(engine_dir)!r}, '--device', 'cpu', '--categories', 'qa,code', '--limit', '1', "
        "'--max-new-tokens', '4', '--warmup', '1', '--methods', 'ar,microspec', '--out', 'bench'])")
    res = json.loads((out / "results.json").read_text())
    assert set(res["runs"]) == {"ar", "microspec"}
    assert set(res["runs"]["ar"]["summary"]) == {"qa", "code", "overall"}


def test_train_draft_eval_finds_the_packaged_data(lone_clone, engine_dir):
    # the acceptance on one short category only (the CPU is slow); the data path is the same for all of them
    out = run(lone_clone, "from trtllm_microspec.train import train_draft; train_draft.EVAL_CATEGORIES = ('qa',); "
              "from trtllm_microspec.cli import main; main(['train-draft', '--engine', "
              f"{str(engine_dir)!r}, '--out', 'head', '--conversations', '6', '--max-len', '64', '--steps', '1', "
              "'--batch-tokens', '64', '--device', 'cpu', '--save-every', '0', '--eval', '--eval-tokens', '4', '--arch', 'eagle2'])")
    r = json.loads(out.strip().splitlines()[-1])
    assert set(r["acceptance"]) == {"eagle", "microspec"} and all(v >= 1.0 for v in r["acceptance"].values())


def test_readme_serving_install_is_ci_s():
    """The README's serving install is one line, and CI runs exactly that line."""
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    lines = [ln for ln in readme.splitlines() if ln.startswith("pip install -e '.[serve]'")]
    assert len(lines) == 1 and "nvidia-pytriton" in lines[0] and "triton-stub-site" in lines[0]
    assert lines[0] in ci.splitlines()


def test_no_file_refers_outside_the_repository():
    """No code, test, script or document reads a folder beside the checkout (a sibling data folder or the like)."""
    # joined here, or this file would match itself
    words = ["/".join(w) for w in (("..", "shared"), ("shared", "data"), ("shared", "GPU.md"))]
    bad = []
    for f in REPO.rglob("*"):
        if (f.suffix in (".py", ".sh", ".md", ".toml", ".pbtxt", ".txt") or f.name == "run") and f.is_file() and \
                not {".venv", ".cache", ".git", "node_modules"} & set(f.relative_to(REPO).parts):
            text = f.read_text(errors="ignore")
            bad += [f"{f.relative_to(REPO)}: {w}" for w in words if w in text]
    assert not bad, bad
