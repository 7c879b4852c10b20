"""Engine builds: a GGUF file, a fetched model key, or a Hugging Face checkpoint directory -> engine directory.

An engine directory holds everything the runtime loads, and nothing of transformers:
  config.json        ModelConfig (architecture, dimensions, rope, vocabulary, EOS ids, max length, dtype)
  model.safetensors  dense weights, HF names without the `model.` prefix (tied heads stored once)
  tokenizer.json     the fast tokenizer; chat_template.jinja when the model has one
  source.json        where it came from, with the input's sha256
transformers (and gguf) are used here only, at build time, to dequantize GGUF and convert its tokenizer.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .model import ModelConfig
from .registry import MODELS, UserError, check_out_dir, fetch, sha256_file

PACKAGED_DRAFTS = Path(__file__).resolve().parents[1] / "drafts"  # trained heads shipped in the package, by model key
ARCHS = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}


def config_from_hf(hf: dict, max_seq_len: int | None, dtype: str, eos_ids: list[int], bos_id) -> ModelConfig:
    hf = hf.get("text_config", hf) if hf.get("model_type") == "gemma3" else hf
    mt = hf.get("model_type")
    if mt not in ARCHS:
        raise UserError(f"unsupported architecture {mt!r}; supported: {', '.join(sorted(set(ARCHS)))}")
    arch = ARCHS[mt]
    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma3 keeps one rope block per layer type
        glob, loc = rope["full_attention"], rope.get("sliding_attention", {})
    else:
        glob, loc = rope, {}
    scaling = hf.get("rope_scaling") or {}
    rtype = glob.get("rope_type", scaling.get("rope_type", "default"))
    if rtype not in ("default", "linear"):
        raise UserError(f"unsupported rope type {rtype!r}")
    heads = hf["num_attention_heads"]
    cfg = ModelConfig(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=float(glob.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling_factor=float(glob.get("factor", scaling.get("factor", 1.0))) if rtype == "linear" else 1.0,
        max_seq_len=int(max_seq_len or min(hf.get("max_position_embeddings", 4096), 8192)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
        dtype=dtype,
        eos_ids=eos_ids,
        bos_id=bos_id,
    )
    if arch == "gemma3":
        cfg.sliding_window = int(hf.get("sliding_window") or 512)
        cfg.rope_local_theta = float(loc.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
        cfg.query_pre_attn_scalar = float(hf.get("query_pre_attn_scalar") or cfg.head_dim)
        pattern = hf.get("sliding_window_pattern", 6)
        cfg.layer_types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg.num_layers)]
        if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
            raise UserError("logit soft-capping is not supported")
    return cfg


def _eos_ids(tok, hf: dict) -> list[int]:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    e = hf.get("eos_token_id")
    ids |= set(e if isinstance(e, list) else [e] if e is not None else [])
    for name in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>"):
        i = tok.convert_tokens_to_ids(name)
        if isinstance(i, int) and i != tok.unk_token_id and i is not None and i >= 0:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


def _load_gguf(path: Path):
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise UserError("building from GGUF needs the build extra: pip install 'trtllm_microspec[build]'")
    try:  # transformers >= 5.24 keeps GGUF weights packed unless asked; older versions always dequantize
        from transformers import GgufConfig
        quant = {"quantization_config": GgufConfig(gguf_file=str(path), dequantize=True)}
    except ImportError:
        quant = {}
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **quant)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise UserError(f"cannot read GGUF {path}: {str(e).splitlines()[0]}")
    return model.config.to_dict(), model.state_dict(), tok


def _load_hf_dir(path: Path):
    from tokenizers import Tokenizer  # noqa: F401  (checked early: the runtime needs tokenizer.json)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UserError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} has no *.safetensors weights")
    try:
        sd = {}
        for f in files:
            sd.update(load_file(f))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise UserError(f"cannot read weights in {path}: {e}")
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise UserError(f"cannot load the tokenizer of {path}: {str(e).splitlines()[0]}")
    return json.loads(cfg_file.read_text()), sd, tok


def build_engine(source: str, out_dir: str | Path, dtype: str = "bfloat16", max_seq_len: int | None = None) -> Path:
    """Build an engine from a model key, a .gguf file, or a HF checkpoint directory."""
    out = Path(out_dir)
    if max_seq_len is not None and max_seq_len < 1:
        raise UserError(f"max_seq_len must be at least 1, got {max_seq_len}")
    check_out_dir(out)
    if source in MODELS:
        src = fetch(source)
    else:
        src = Path(source)
        if not src.exists():
            raise UserError(f"{source} is neither a model key ({', '.join(MODELS)}) nor an existing path")
    print(f"building engine from {src} ...", file=sys.stderr, flush=True)
    hf, sd, tok = _load_gguf(src) if src.is_file() else _load_hf_dir(src)
    context = hf.get("max_position_embeddings")
    if max_seq_len is not None and context and max_seq_len > context:
        raise UserError(f"max_seq_len {max_seq_len} is more than the model's context of {context} tokens")
    cfg = config_from_hf(hf, max_seq_len, dtype, _eos_ids(tok, hf), tok.bos_token_id)
    tdtype = getattr(torch, dtype)
    weights = {k.removeprefix("model."): v.to(tdtype).contiguous() for k, v in sd.items()
               if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _check_weights(cfg, weights)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)  # a rebuild cut short must not look finished
    save_file(weights, out / "model.safetensors")
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    (out / "chat_template.jinja").unlink(missing_ok=True)
    if template:
        (out / "chat_template.jinja").write_text(template)
    special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    (out / "tokenizer_config.json").write_text(json.dumps(special, indent=2) + "\n")
    digest = sha256_file(src) if src.is_file() else None
    source_rec = {"source": str(source), "path": str(src), "sha256": digest, "hf_config": hf}
    (out / "source.json").write_text(json.dumps(source_rec, indent=2, default=str) + "\n")
    # a registry model built from its key or from its GGUF moved by hand (known by its sha256) is the same model
    key = source if source in MODELS else next((k for k, m in MODELS.items() if m.sha256 == digest), "")
    packaged = PACKAGED_DRAFTS / key
    if key and packaged.is_dir():  # the default model ships a trained EAGLE head: it becomes the engine's default draft
        shutil.copytree(packaged, out / "eagle", dirs_exist_ok=True)
    cfg.save(out / "config.json")  # last: an interrupted build leaves no config.json, so it is rebuilt, not loaded
    print(f"engine written to {out}", file=sys.stderr)
    return out


def _check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose tensors do not fit the architecture (a corrupt or mislabelled input)."""
    from .model import Transformer

    with torch.device("meta"):
        expected = Transformer(cfg).state_dict()
    missing = [k for k in expected if k not in weights]
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != tuple(expected[k].shape)]
    if missing or wrong:
        raise UserError(f"checkpoint does not match a {cfg.arch} model: missing {missing[:3]}, wrong shape {wrong[:3]}")
