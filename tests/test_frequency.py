"""`microspec build-freq`: the ranking is right on a known text, and FR-Spec with it stays lossless."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trtllm_microspec import LLM
from trtllm_microspec.cli import main
from trtllm_microspec.llm import FREQ_FILE
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.models.tokenizer import Tokenizer
from trtllm_microspec.vocab.frequency import build_freq


@pytest.fixture
def engine(engine_dir, tmp_path):
    """The shared engine's files linked into a fresh dir, so the frequency file is written there only."""
    e = tmp_path / "engine"
    e.mkdir()
    for f in engine_dir.iterdir():
        if f.name != FREQ_FILE:
            (e / f.name).symlink_to(f)
    return e


def test_ranking_on_known_text(engine, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat and the dog\n" * 5 + "a cat\n")
    main(["build-freq", "--engine", str(engine), "--corpus", str(corpus)])
    f = load_file(engine / FREQ_FILE)
    ranked, counts = f["ranked_ids"], f["counts"]
    V = json.loads((engine / "config.json").read_text())["vocab_size"]
    assert ranked.dtype == torch.int64 and torch.equal(ranked.sort().values, torch.arange(V))
    tok = Tokenizer(engine)
    the = tok.encode(" the")[0]
    assert int(ranked[0]) == the and int(counts[the]) == 10  # " the" twice per line (the first "the" differs)
    assert int(counts[tok.encode(" cat")[0]]) == 6
    assert int(counts.sum()) == sum(len(tok.encode(line)) for line in corpus.read_text().splitlines(True))
    ordered = counts[ranked]
    assert torch.all(ordered[:-1] >= ordered[1:])
    zero = ranked[ordered == 0]  # unseen ids: ties ranked by id
    assert torch.equal(zero, zero.sort().values)


def test_jsonl_and_bad_corpus(engine, tmp_path):
    j = tmp_path / "c.jsonl"
    j.write_text("\n".join(json.dumps({"text": t}) for t in ["hello hello hello", "hello world"]) + "\n")
    build_freq(engine, str(j), limit=1)  # only the first line
    f = load_file(engine / FREQ_FILE)
    assert int(f["counts"].sum()) == len(Tokenizer(engine).encode("hello hello hello"))
    with pytest.raises(UserError):
        build_freq(engine, str(tmp_path / "missing.txt"))


def test_frspec_lossless(engine, tmp_path, random_draft_dir):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Paris is the capital of France. The sea is blue and the sky is wide.\n" * 3)
    build_freq(engine, str(corpus))
    prompt = "What is the capital of France?"
    ar = LLM(engine, "ar", max_seq_len=256).generate(prompt, max_new_tokens=24, chat=True)
    fr = LLM(engine, "frspec", draft=random_draft_dir, static_k=64, max_seq_len=256).generate(
        prompt, max_new_tokens=24, chat=True)
    assert fr.token_ids == ar.token_ids and len(ar.token_ids) > 0
    ms = LLM(engine, "microspec", draft=random_draft_dir, w_max=64, max_seq_len=256)  # the filled window
    assert ms.generate(prompt, max_new_tokens=24, chat=True).token_ids == ar.token_ids
    ranked = load_file(engine / FREQ_FILE)["ranked_ids"]
    assert torch.equal(ms.vocab.fill_ids, ranked[:64])  # its fill's ranking: W_max ids, the pinned EOS counted inside


@pytest.mark.parametrize("bad", ["other", "cut"])
def test_bad_ranking_is_named(engine, random_draft_dir, bad):
    """A ranking of another vocabulary or a file cut short: one line naming the file and the command that
    rebuilds it, for frspec and for microspec's fill alike."""
    from safetensors.torch import save_file

    f = engine / FREQ_FILE
    if bad == "other":
        save_file({"ranked_ids": torch.arange(60000)}, f)  # a larger vocabulary's
    else:
        save_file({"ranked_ids": torch.arange(100)}, f)
        f.write_bytes(f.read_bytes()[:50])
    for method in ("frspec", "microspec"):
        with pytest.raises(UserError, match="is damaged .*microspec build-freq --engine") as e:
            LLM(engine, method, draft=random_draft_dir, max_seq_len=64)
        assert "\n" not in str(e.value)
