"""Engine builds from a Hugging Face checkpoint directory, refusals of bad inputs, the model registry's fetch,
and the official-EAGLE-checkpoint loader `build_draft`."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_microspec import LLM
from trtllm_microspec.engine.loader import load_target
from trtllm_microspec.models import registry
from trtllm_microspec.models.build import build_engine
from trtllm_microspec.models.model import ModelConfig, Span
from trtllm_microspec.models.registry import ModelSpec, UserError
from trtllm_microspec.speculative.eagle import EagleDraft, build_draft, draft_config

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def link_dir(src, dst, skip=()):
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            (dst / f.name).symlink_to(f)
    return dst


@pytest.fixture(scope="module")
def hf_dir(engine_dir, tmp_path_factory):
    """A HF checkpoint made from the GGUF-built engine: config.json, `model.`-prefixed safetensors, tokenizer."""
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("hf")
    hf = json.loads((engine_dir / "source.json").read_text())["hf_config"]
    (out / "config.json").write_text(json.dumps(hf))
    save_file({"model." + k: v for k, v in load_file(engine_dir / "model.safetensors").items()},
              out / "model.safetensors")
    special = json.loads((engine_dir / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(engine_dir / "tokenizer.json"), **special)
    tok.unk_token = tok.convert_ids_to_tokens(hf["unk_token_id"])  # as SmolLM2's own tokenizer_config has it
    tok.chat_template = (engine_dir / "chat_template.jinja").read_text()
    tok.save_pretrained(out)
    return out


def test_hf_dir_build_matches_gguf_build(engine_dir, hf_dir, tmp_path):
    out = build_engine(str(hf_dir), tmp_path / "engine")
    assert ModelConfig.load(out / "config.json") == ModelConfig.load(engine_dir / "config.json")
    assert (out / "chat_template.jinja").read_text() == (engine_dir / "chat_template.jinja").read_text()
    a, tok_a = load_target(engine_dir, torch.device("cpu"), torch.float32)
    b, tok_b = load_target(out, torch.device("cpu"), torch.float32)
    ids = tok_a.prompt_ids(PROMPT, chat=True)
    assert tok_b.prompt_ids(PROMPT, chat=True) == ids
    ids = torch.tensor(ids)
    pos = torch.arange(len(ids))
    span = Span(torch.tensor(0), pos[None, :] <= pos[:, None], len(ids))
    with torch.no_grad():
        assert torch.equal(a.logits(a(ids, pos, pos, span)), b.logits(b(ids, pos, pos, span)))
    assert not (out / "eagle").exists()  # an unknown checkpoint gets no packaged head


def test_registry_gguf_built_from_its_path_gets_the_packaged_head(engine_dir, tmp_path):
    # a GGUF moved by hand (e.g. to the GPU machine) is recognised by its sha256 as the registry model it is
    out = build_engine(str(registry.gguf_path("smollm2-135m")), tmp_path / "engine")
    assert (out / "eagle" / "model.safetensors").read_bytes() == (engine_dir / "eagle" / "model.safetensors").read_bytes()


def test_unsupported_architecture(hf_dir, tmp_path):
    bad = link_dir(hf_dir, tmp_path / "mamba", skip={"config.json"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(UserError, match="unsupported architecture 'mamba'.*llama"):
        build_engine(str(bad), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupt_safetensors(hf_dir, tmp_path):
    bad = link_dir(hf_dir, tmp_path / "corrupt", skip={"model.safetensors"})
    with open(hf_dir / "model.safetensors", "rb") as f:
        (bad / "model.safetensors").write_bytes(f.read(1 << 20))  # truncated
    with pytest.raises(UserError, match="cannot read weights"):
        build_engine(str(bad), tmp_path / "out")


def test_checkpoint_not_matching_config(hf_dir, tmp_path):
    bad = link_dir(hf_dir, tmp_path / "deeper", skip={"config.json"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    with pytest.raises(UserError, match="does not match"):
        build_engine(str(bad), tmp_path / "out")


def test_missing_source(tmp_path):
    with pytest.raises(UserError, match="neither a model key"):
        build_engine(str(tmp_path / "nope"), tmp_path / "out")
    with pytest.raises(UserError, match="no config.json"):
        build_engine(str(tmp_path), tmp_path / "out")


# --- registry -------------------------------------------------------------------------------------------

SIX = "4ce39f422ee71467ccac8bed76beb05f8c321c7f0ceda9279ae2dfa3670106b3"  # six.py in six-1.16.0's wheel


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A registry entry for an 11 kB wheel (six), fetched into an empty cache."""
    monkeypatch.setenv("MICROSPEC_CACHE", str(tmp_path))

    def add(sha256):
        spec = ModelSpec("tiny", "six.py", ("six==1.16.0",), ("six.py",), sha256, 34549)
        monkeypatch.setitem(registry.MODELS, "tiny", spec)
        return spec
    return add


def test_fetch_sha256_mismatch_leaves_nothing(tiny, tmp_path):
    tiny("0" * 64)
    with pytest.raises(UserError, match="sha256 mismatch"):
        registry.fetch("tiny")
    assert list((tmp_path / "models" / "tiny").iterdir()) == []


def test_fetch_verifies_and_is_idempotent(tiny, monkeypatch):
    tiny(SIX)
    path = registry.fetch("tiny")
    assert path == registry.gguf_path("tiny") and registry.sha256_file(path) == SIX
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind

    def no_download(*a, **k):
        raise AssertionError("fetch downloaded again")
    monkeypatch.setattr(subprocess, "run", no_download)
    assert registry.fetch("tiny") == path


def test_fetch_cached_real_model_is_idempotent(engine_dir, monkeypatch):
    def no_download(*a, **k):
        raise AssertionError("fetch downloaded again")
    monkeypatch.setattr(subprocess, "run", no_download)
    assert registry.fetch("smollm2-135m") == registry.gguf_path("smollm2-135m")


def test_fetch_unknown_key():
    with pytest.raises(UserError, match="valid keys: smollm2-135m"):
        registry.fetch("bad-key")


# --- official EAGLE checkpoints -------------------------------------------------------------------------

def eagle_checkpoint(engine_dir, out, hidden_size=None):
    """An EAGLE-1 style directory: config.json + pytorch_model.bin with fc.* (with bias) and layers.0.*,
    plus an input_layernorm and an embedding copy that the loader must ignore. Returns the expected weights."""
    torch.manual_seed(1)
    tcfg = ModelConfig.load(engine_dir / "config.json")
    sd = {k: v.to(torch.bfloat16) for k, v in EagleDraft(draft_config(tcfg), bias=True).state_dict().items()}
    out.mkdir()
    torch.save({**sd, "layers.0.input_layernorm.weight": torch.ones(tcfg.hidden_size),
                "embed_tokens.weight": torch.zeros(4, tcfg.hidden_size)}, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden_size or tcfg.hidden_size,
        "num_attention_heads": tcfg.num_heads, "num_key_value_heads": tcfg.num_kv_heads,
        "intermediate_size": tcfg.intermediate_size, "num_hidden_layers": 1, "vocab_size": tcfg.vocab_size}))
    return sd


def test_build_draft_from_eagle_checkpoint(engine_dir, tmp_path):
    want = eagle_checkpoint(engine_dir, tmp_path / "ck")
    out, what = build_draft(tmp_path / "ck", engine_dir, tmp_path / "draft")
    assert what == "EAGLE-1/2 head"
    got = load_file(out / "model.safetensors")
    assert got.keys() == want.keys()  # input_layernorm and embed_tokens dropped
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "config.json").read_text())["bias"] is True
    ar = LLM(engine_dir, "ar", device="cpu").generate(PROMPT, 16)
    spec = LLM(engine_dir, "eagle", draft=out, device="cpu", depth=2, top_k=4, total_tokens=10,
               spec_policy="fixed").generate(PROMPT, 16)  # every step a round: rounds ran with the built head
    assert spec.token_ids == ar.token_ids and spec.stats["rounds"] > 0


def test_build_draft_refuses_wrong_hidden_size(engine_dir, tmp_path):
    eagle_checkpoint(engine_dir, tmp_path / "ck", hidden_size=1024)
    with pytest.raises(UserError, match="hidden size 1024"):
        build_draft(tmp_path / "ck", engine_dir, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


def test_build_draft_refuses_incomplete_checkpoint(engine_dir, tmp_path):
    eagle_checkpoint(engine_dir, tmp_path / "ck")
    sd = torch.load(tmp_path / "ck" / "pytorch_model.bin", weights_only=True)
    del sd["layers.0.mlp.down_proj.weight"]
    torch.save(sd, tmp_path / "ck" / "pytorch_model.bin")
    with pytest.raises(UserError, match="lacks.*down_proj"):
        build_draft(tmp_path / "ck", engine_dir, tmp_path / "draft")
