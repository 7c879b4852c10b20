"""The trained EAGLE head shipped for the default model: it lands in <engine>/eagle, is the default draft, speculates
for real (more than one token per round on chat prompts) and stays lossless; `microspec quickstart` runs end to end."""
from __future__ import annotations

import pytest

from trtllm_microspec.cli import main
from trtllm_microspec.llm import LLM

PROMPTS = ["Explain in a few sentences why the sky is blue.", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def ar(engine_dir):
    return LLM(engine_dir, "ar")


def test_head_is_installed_with_the_engine(engine_dir):
    assert (engine_dir / "eagle" / "model.safetensors").is_file()
    assert (engine_dir / "eagle" / "config.json").is_file()


def test_default_head_speculates_losslessly(engine_dir, ar):
    llm = LLM(engine_dir, "microspec", spec_policy="fixed")  # no draft given: <engine>/eagle; every step a round
    rounds = tokens = 0
    for p in PROMPTS:
        r = llm.generate(p, 40, chat=True)
        assert r.token_ids == ar.generate(p, 40, chat=True).token_ids
        rounds += r.stats["rounds"]
        tokens += r.stats["round_tokens"]
    # a random head accepts ~1.0 token per round; the trained one must do clearly better
    assert tokens / rounds > 1.3


def test_quickstart(capsys):
    main(["quickstart", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert "identical to AR greedy: True" in out
    assert "== microspec:" in out and "acceptance length" in out
    assert "== tree: depth 3, tree-top-k 4, 12 tokens (unset knobs: the CPU's tree)" in out  # the CPU's small tree


def test_quickstart_tree_knobs_given_win(capsys):
    main(["quickstart", "--max-new-tokens", "8", "--depth", "2", "--total-tokens", "9"])
    out = capsys.readouterr().out
    assert "== tree: depth 2, tree-top-k 4, 9 tokens" in out and "identical to AR greedy: True" in out
