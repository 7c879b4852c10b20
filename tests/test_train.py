"""`microspec train-draft` on the CPU: a few steps on a handful of real ShareGPT conversations with the real
SmolLM2 engine lower the held-out loss, the head loads and generates, and an interrupted run resumed from its
checkpoint ends with the same weights as an uninterrupted one with the same seed."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from trtllm_microspec import LLM
from trtllm_microspec.data import sharegpt_conversations
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.train.train_draft import CHECKPOINT, train

KW = dict(max_len=64, steps=4, lr=1e-3, batch_tokens=64, seed=3, device="cpu", save_every=2, heldout=0.25)


@pytest.fixture(scope="module")
def convs():
    return sharegpt_conversations(6)


@pytest.fixture(scope="module")
def trained(engine_dir, convs, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    return out, train(engine_dir, out, data=convs, **KW)


def test_sharegpt_conversations(convs):
    assert len(convs) == 6
    for c in convs:
        assert c[0]["role"] == "user" and all(m["role"] == ("user", "assistant")[i % 2] for i, m in enumerate(c))
    assert sharegpt_conversations(3) == convs[:3]  # deterministic order


def test_heldout_loss_goes_down(trained):
    _, r = trained
    assert r["steps"] == 4 and r["heldout_positions"] > 0
    assert r["heldout_loss"] < r["heldout_loss_start"] - 0.1


def test_saved_head_generates(engine_dir, trained):
    out, _ = trained
    assert {k.split(".")[0] for k in load_file(out / "model.safetensors")} == {"fc", "layers"}
    r = LLM(engine_dir, method="eagle", draft=out, max_seq_len=256).generate("Hello!", max_new_tokens=8, chat=True)
    assert r.num_new_tokens > 0 and r.stats["rounds"] > 0  # speculative rounds ran with the trained head


def test_resume_matches_uninterrupted_run(engine_dir, convs, trained, tmp_path, monkeypatch):
    out, _ = trained
    saves, real_save = [], torch.save

    def save_then_stop(obj, path):  # interrupt the run right after its first checkpoint (step 2)
        real_save(obj, path)
        saves.append(obj["step"])
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train(engine_dir, tmp_path, data=convs, **KW)
    monkeypatch.undo()
    assert saves == [2]
    with pytest.raises(UserError):  # other settings than the checkpoint's
        train(engine_dir, tmp_path, data=convs, resume=True, **{**KW, "seed": 4})
    r = train(engine_dir, tmp_path, data=convs, resume=True, **KW)
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["step"] == 4 == r["steps"]
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
