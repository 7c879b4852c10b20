"""Load engine directories (target and EAGLE draft) onto a device."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..models.model import ModelConfig, Transformer
from ..models.registry import UserError
from ..models.tokenizer import Tokenizer


def pick_device(device: str | None, dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA (bf16 unless asked otherwise) when available or asked for, else CPU in fp32."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but no CUDA device is available")
    if dtype not in (None, "bfloat16", "float16", "float32"):
        raise UserError(f"unknown dtype {dtype!r}; choose bfloat16, float16 or float32")
    return dev, getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def read_config(engine_dir: str | Path, kind: str = "engine") -> ModelConfig:
    d = Path(engine_dir)
    if not (d / "config.json").exists():
        raise UserError(f"{d} is not an {kind} directory (no config.json); build one with `microspec build`")
    return ModelConfig.load(d / "config.json")


def load_target(engine_dir: str | Path, device: torch.device, dtype: torch.dtype,
                max_seq_len: int | None = None) -> tuple[Transformer, Tokenizer]:
    d = Path(engine_dir)
    cfg = read_config(d)
    if max_seq_len:
        cfg.max_seq_len = min(cfg.max_seq_len, max_seq_len)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(load_file(d / "model.safetensors"), strict=True, assign=True)
    return model.setup(dtype, device).eval(), Tokenizer(d)
