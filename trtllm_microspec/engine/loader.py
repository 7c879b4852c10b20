"""Load engine directories (target and EAGLE draft) onto a device."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .. import parallel
from ..models.model import ModelConfig, Transformer
from ..models.registry import MODELS, UserError, cache_dir
from ..models.tokenizer import Tokenizer

ENGINE_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json")  # besides config.json


def pick_device(device: str | None, dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA (bf16 unless asked otherwise) when available or asked for, else CPU in fp32."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index is not None):
        raise UserError(f"unknown device {device!r}; use cpu, cuda or cuda:N")  # torch knows meta, xpu, cpu:7 ...
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but no CUDA device is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices (cuda:0 to "
                        f"cuda:{torch.cuda.device_count() - 1})")
    if dtype not in (None, "bfloat16", "float16", "float32"):
        raise UserError(f"unknown dtype {dtype!r}; choose bfloat16, float16 or float32")
    return dev, getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def read_config(engine_dir: str | Path, kind: str = "engine") -> ModelConfig:
    d = Path(engine_dir)
    if not (d / "config.json").exists():
        raise UserError(f"{d} is not an {kind} directory (no config.json); build one with `microspec build`")
    try:
        return ModelConfig.load(d / "config.json")
    except (ValueError, TypeError) as e:  # not JSON, or not a model configuration
        raise damaged(d, f"config.json: {e}") from None


def one_line(text: str) -> str:
    """A message as one short line (torch's and safetensors' span several lines)."""
    text = " ".join(str(text).split())
    return text if len(text) <= 200 else text[:200] + " ..."


def rebuild_command(d: Path) -> str:
    """How to rebuild engine `d`: a cached model key's engine by its key, any other from the source it recorded."""
    key = next((k for k in MODELS if d.resolve() == (cache_dir() / "engines" / k).resolve()), None)
    if key:
        return f"microspec build {key} --force"
    try:
        source = json.loads((d / "source.json").read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        source = "SOURCE"
    return f"microspec build {source} --out {d} --force"


def damaged(d: Path, why: str) -> UserError:
    return UserError(f"{d} is damaged ({one_line(why)}): rebuild it with `{rebuild_command(d)}`")


def load_target(engine_dir: str | Path, device: torch.device, dtype: torch.dtype, max_seq_len: int | None = None,
                draft_head: bool = False) -> tuple[Transformer, Tokenizer]:
    """draft_head: under TP, also keep the whole LM head (`full_head`) for a draft vocabulary."""
    d = Path(engine_dir)
    cfg = read_config(d)
    if max_seq_len:
        cfg.max_seq_len = min(cfg.max_seq_len, max_seq_len)
    missing = [f for f in ENGINE_FILES if not (d / f).exists()]
    if missing:
        raise damaged(d, f"missing {', '.join(missing)}")
    tp = parallel.world() > 1
    local = parallel.shard_config(cfg) if tp else cfg
    # any failure reading the files (cut short, another model's weights, a config edited by hand) means: rebuild
    try:
        with torch.device("meta"):
            model = Transformer(local)
        sd = load_file(d / "model.safetensors")
        if tp:
            full_head = sd["embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
            sd = parallel.shard_state_dict(sd, cfg)
        model.load_state_dict(sd, strict=True, assign=True)
    except Exception as e:
        raise damaged(d, f"weights: {e}") from None
    try:
        tokenizer = Tokenizer(d)
    except Exception as e:
        raise damaged(d, f"tokenizer: {e}") from None
    model.setup(dtype, device).eval()
    if tp and draft_head:  # each rank gathers the draft vocabulary's rows from its own copy (docs/parallel.md)
        model.full_head = full_head.to(device=device, dtype=dtype)
    return model, tokenizer
