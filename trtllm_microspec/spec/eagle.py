"""EAGLE-1/2 draft head: fc(concat(token embedding, target feature)) -> one decoder layer (input norm skipped).

It owns no embedding and no LM head: it borrows the target's (the LM head goes through a draft vocabulary).
Draft engine directory: config.json (a ModelConfig of the single layer, plus `bias` and `target`) and
model.safetensors with `fc.*` and `layers.0.*` -- the official EAGLE layout, so official heads load too.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from plugins import layers

from ..models.model import Block, KVCache, ModelConfig, Span, Transformer, rope_tables
from ..models.registry import UserError


class EagleDraft(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.cfg, self.bias = cfg, bias
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=bias)
        self.layers = nn.ModuleList([Block(cfg, skip_input_norm=True)])

    def setup(self, target: Transformer, dtype, device) -> "EagleDraft":
        self.to(device=device, dtype=dtype).requires_grad_(False)  # inference; training re-enables
        self.target = [target]  # a list, so the target is not registered as a sub-module
        self.rope = rope_tables(self.cfg, self.cfg.rope_theta, self.cfg.rope_scaling_factor, device)
        self.cache = KVCache(self.cfg, 1, dtype, device)
        return self

    def hidden(self, tokens, features, positions, slots, span: Span, cache: KVCache | None = None) -> torch.Tensor:
        """tokens [T] (token t+1), features [T, d] (target/draft feature at t) -> draft hidden [T, d]."""
        cache = cache or self.cache
        slots = span.physical(slots)
        cache.write_pos(slots, positions)
        x = layers.linear(torch.cat([self.target[0].embed(tokens), features.to(self.fc.weight.dtype)], dim=-1),
                          self.fc.weight, self.fc.bias)
        attn_args = (self.rope, positions, slots, span, cache.pos, 0, cache.k[0], cache.v[0])
        res, delta = self.layers[0](x, None, None, attn_args)
        return res + delta

    def forward(self, tokens, features, positions, slots, span: Span) -> torch.Tensor:
        return self.hidden(tokens, features, positions, slots, span)


def draft_config(target: ModelConfig) -> ModelConfig:
    """The single draft layer has the target's shapes and a plain (non-sliding) attention."""
    d = ModelConfig(**{**target.__dict__, "num_layers": 1, "layer_types": [], "sliding_window": 0})
    return d


def save_draft(model: EagleDraft, out_dir: Path, target_engine: Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, out_dir / "model.safetensors")
    cfg = {**model.cfg.__dict__, "bias": model.bias, "target": _target_record(target_engine)}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _target_record(engine: Path) -> dict:
    c = ModelConfig.load(Path(engine) / "config.json")
    return {"arch": c.arch, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size}


def load_draft(draft_dir: str | Path, target: Transformer, dtype, device) -> EagleDraft:
    d = Path(draft_dir)
    if not (d / "config.json").exists() or not (d / "model.safetensors").exists():
        raise UserError(f"{d} is not a draft directory (needs config.json and model.safetensors); "
                        f"build one with `microspec build-draft`")
    raw = json.loads((d / "config.json").read_text())
    t = target.cfg
    want = raw.get("target", {})
    if raw.get("hidden_size") != t.hidden_size or want.get("vocab_size", t.vocab_size) != t.vocab_size:
        raise UserError(f"draft {d} was built for hidden size {raw.get('hidden_size')} / vocabulary "
                        f"{want.get('vocab_size')}, but the target has {t.hidden_size} / {t.vocab_size}")
    cfg = ModelConfig(**{k: v for k, v in raw.items() if k in ModelConfig.__dataclass_fields__})
    with torch.device("meta"):
        model = EagleDraft(cfg, bias=bool(raw.get("bias", False)))
    model.load_state_dict(load_file(d / "model.safetensors"), strict=True, assign=True)
    return model.setup(target, dtype, device).eval()


def build_draft(checkpoint: str | Path, target_engine: str | Path, out_dir: str | Path) -> Path:
    """Official EAGLE-1/2 checkpoint (config.json + pytorch_model.bin / model.safetensors) -> draft directory."""
    ck, target_engine = Path(checkpoint), Path(target_engine)
    tcfg = ModelConfig.load(target_engine / "config.json") if (target_engine / "config.json").exists() else None
    if tcfg is None:
        raise UserError(f"{target_engine} is not an engine directory")
    if not (ck / "config.json").exists():
        raise UserError(f"{ck} has no config.json")
    hf = json.loads((ck / "config.json").read_text())
    files = [ck / "model.safetensors", ck / "pytorch_model.bin"]
    wfile = next((f for f in files if f.exists()), None)
    if wfile is None:
        raise UserError(f"{ck} has neither model.safetensors nor pytorch_model.bin")
    try:
        sd = load_file(wfile) if wfile.suffix == ".safetensors" else torch.load(wfile, map_location="cpu",
                                                                                weights_only=True)
    except Exception as e:
        raise UserError(f"cannot read {wfile}: {str(e).splitlines()[0]}")
    sd = {k.removeprefix("model."): v for k, v in sd.items() if k.startswith(("fc.", "layers.0.", "model.fc.",
                                                                           "model.layers.0."))}
    if hf.get("hidden_size") != tcfg.hidden_size or hf.get("vocab_size", tcfg.vocab_size) != tcfg.vocab_size:
        raise UserError(f"EAGLE checkpoint has hidden size {hf.get('hidden_size')} / vocabulary "
                        f"{hf.get('vocab_size')}; the target has {tcfg.hidden_size} / {tcfg.vocab_size}")
    cfg = draft_config(tcfg)
    model = EagleDraft(cfg, bias="fc.bias" in sd)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing:
        raise UserError(f"EAGLE checkpoint lacks {missing[:4]}")
    save_draft(model, Path(out_dir), target_engine)
    return Path(out_dir)
