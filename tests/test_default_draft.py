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


# held-out chat prompts of several kinds (the window's stream differs: prose, code, a list, a translation)
CAP_PROMPTS = PROMPTS + ["List five fruits and their colours.", "Translate into French: the cat sleeps on the warm mat."]


@pytest.mark.parametrize("method,w_max", [("microspec", 3072), ("microspec-paper", 48)])
def test_window_stays_within_w_max(engine_dir, method, w_max):
    """Every round's draft vocabulary, the pinned EOS, the stream and the fill together, is at most W_max; the
    filled window is always exactly full, the paper's small one fills up (its stream outgrows 48 ids)."""
    llm = LLM(engine_dir, method, w_max=w_max, spec_policy="fixed")
    sizes = []
    for p in CAP_PROMPTS:
        s = llm.generate(p, 16, chat=True).stats
        assert s["rounds"] > 0 and s["vocab_max"] <= w_max, (p, s["vocab_max"])
        sizes.append(s["vocab_max"])
    assert max(sizes) == w_max
