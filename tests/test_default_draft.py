"""The trained EAGLE head shipped for the default model: it lands in <engine>/eagle, is the default draft, speculates
for real (more than one token per round on chat prompts) and stays lossless; `microspec quickstart` runs end to end."""
from __future__ import annotations

import json

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


def test_policy_default_follows_what_is_named():
    """--spec-policy unset: generate runs the method asked for (fixed), so does any command naming a tree; serve and
    bench otherwise follow the load (auto); an explicit --spec-policy always wins."""
    from trtllm_microspec.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["generate", "--prompt", "x", "--method", "eagle"]).spec_policy == "fixed"
    assert parse(["generate", "--prompt", "x", "--method", "eagle", "--spec-policy", "auto"]).spec_policy == "auto"
    assert parse(["serve"]).spec_policy == "auto"
    assert parse(["serve", "--depth", "2"]).spec_policy == "fixed"
    assert parse(["serve", "--total-tokens", "9", "--spec-policy", "auto"]).spec_policy == "auto"
    assert parse(["bench", "--tree-top-k", "3"]).spec_policy == "fixed"
    assert parse(["bench"]).spec_policy == "auto"


def run_json(capsys, *args):
    main(["generate", "--method", "eagle", "--chat", "--json", "--max-new-tokens", "12", "--prompt",
          CAP_PROMPTS[3], *args])
    out = capsys.readouterr()
    return json.loads(out.out)["stats"], out.err


def test_generate_says_why_it_decoded_plainly(capsys, monkeypatch):
    """The shipped head, generate --method eagle: with no policy named it speculates (every step a round); under
    --spec-policy auto with a tree whose calibrated round costs 1,000 s (mocked; a plain step's cost follows what
    its steps take, a tree never run keeps its calibration) every step runs plain:
    the JSON counts them with their reason and reports no acceptance (null, not 0.0), and one line on stderr says
    it decoded plainly and why."""
    from trtllm_microspec.engine.spec_runner import SpecRunner

    s, err = run_json(capsys)
    assert s["rounds"] > 0 and s["acceptance_length"] >= 1 and s["plain_steps"] == 0
    assert "decoded plainly" not in err
    monkeypatch.setattr(SpecRunner, "measure", lambda self, shape, rows: 1e3 if self.shapes[shape] else 0.01)
    s, err = run_json(capsys, "--spec-policy", "auto")
    assert s["rounds"] == 0 and s["acceptance_length"] is None and s["vocab_mean"] is None
    assert s["plain_steps"] == s["new_tokens"] - 1 > 0 and s["plain_reasons"] == {"cost": s["plain_steps"]}
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("microspec: decoded plainly") and "costs more" in lines[0], err
