"""EAGLE-1/2 draft head: fc(concat(token embedding, target feature)) -> one decoder layer (input norm skipped);
the loaders of draft directories and of the EAGLE checkpoints users bring (EAGLE-3: speculative/eagle3.py).

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
from ..models.registry import UserError, check_out_dir


class EagleDraft(nn.Module):
    version = 2  # EAGLE-1/2 (speculative/eagle3.py: EAGLE-3, with the same interface)

    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.cfg, self.bias = cfg, bias
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=bias)
        self.layers = nn.ModuleList([Block(cfg, skip_input_norm=True)])

    def setup(self, target: Transformer, dtype, device) -> "EagleDraft":
        self.to(device=device, dtype=dtype).requires_grad_(False)  # inference; training re-enables
        self.target = [target]  # a list, so the target is not registered as a sub-module
        self.rope = rope_tables(self.cfg, self.cfg.rope_theta, self.cfg.rope_scaling_factor, device)
        return self  # no KV cache of its own: the caller's (the batched engine's paged pool) comes with each call

    def hidden(self, tokens, features, positions, slots, span: Span, cache: KVCache) -> torch.Tensor:
        """tokens [T] (token t+1), features [T, d] (target/draft feature at t) -> draft hidden [T, d]; the layer's
        K and V go into cache (shaped by self.cfg: KVCache(draft.cfg, 1, ...))."""
        slots = span.physical(slots)
        cache.write_pos(slots, positions)
        x = layers.linear(torch.cat([self.target[0].embed(tokens), features.to(self.fc.weight.dtype)], dim=-1),
                          self.fc.weight, self.fc.bias)
        attn_args = (self.rope, positions, slots, span, cache.pos, 0, cache.k[0], cache.v[0])
        res, delta = self.layers[0](x, None, None, attn_args)
        return res + delta

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """The target's final-normed hidden h -> the draft's input feature there: h itself."""
        return h

    def head_in(self, h: torch.Tensor) -> torch.Tensor:
        """The draft hidden -> the LM head's input: the hidden itself (it predicts the target's normed feature)."""
        return h

    def vocab_rows(self) -> tuple[torch.Tensor, None]:
        """The LM head's rows (the target's, all of them under TP) and their ids (None: row i is id i)."""
        t = self.target[0]
        return (t.head_weight if t.full_head is None else t.full_head), None


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


def load_draft(draft_dir: str | Path, target: Transformer, dtype, device):
    """A draft directory -> EagleDraft (EAGLE-1/2) or Eagle3Draft, set up on the target."""
    from .eagle3 import load_draft3

    d = Path(draft_dir)
    if not (d / "config.json").exists() or not (d / "model.safetensors").exists():
        raise UserError(f"{d} is not a draft directory (needs config.json and model.safetensors); "
                        f"build one with `microspec build-draft`")
    raw = json.loads((d / "config.json").read_text())
    if raw.get("eagle") == 3:
        return load_draft3(raw, load_file(d / "model.safetensors"), target).setup(target, dtype, device).eval()
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


def build_draft(checkpoint: str | Path, target_engine: str | Path, out_dir: str | Path) -> tuple[Path, str]:
    """An EAGLE checkpoint (config.json + model.safetensors / pytorch_model.bin) -> draft directory. Detects
    EAGLE-1/2 (fc over [embedding ; feature]) and EAGLE-3 in SafeAILab's, SpecForge's and speculators' (vLLM)
    layouts. Returns the directory and what was loaded."""
    from .eagle3 import convert, is_eagle3, layout_of, read_target_embed, save_draft3

    ck, target_engine = Path(checkpoint), Path(target_engine)
    check_out_dir(out_dir)
    tcfg = ModelConfig.load(target_engine / "config.json") if (target_engine / "config.json").exists() else None
    if tcfg is None:
        raise UserError(f"{target_engine} is not an engine directory")
    if not (ck / "config.json").exists():
        raise UserError(f"{ck} has no config.json")
    try:
        hf = json.loads((ck / "config.json").read_text())
    except ValueError as e:
        raise UserError(f"{ck / 'config.json'} is not JSON ({e})") from None
    files = [ck / "model.safetensors", ck / "pytorch_model.bin"]
    wfile = next((f for f in files if f.exists()), None)
    if wfile is None:
        raise UserError(f"{ck} has neither model.safetensors nor pytorch_model.bin")
    try:
        sd = load_file(wfile) if wfile.suffix == ".safetensors" else torch.load(wfile, map_location="cpu",
                                                                                weights_only=True)
    except Exception as e:
        raise UserError(f"cannot read {wfile}: {str(e).splitlines()[0]}")
    if is_eagle3(hf, sd):
        layout = layout_of(hf)
        try:
            model = convert(hf, sd, tcfg, read_target_embed(target_engine), layout)
        except (RuntimeError, KeyError, TypeError, ValueError) as e:  # a tensor of another shape, a key missing
            raise UserError(f"{layout} checkpoint {ck} does not fit: {' '.join(str(e).split())[:200]}") from None
        save_draft3(model, Path(out_dir), _target_record(target_engine), layout)
        return Path(out_dir), f"{layout} head (draft vocabulary {model.lm_head.out_features}, target layers " \
                              f"{model.taps})"
    sd = {k.removeprefix("model."): v for k, v in sd.items() if k.startswith(("fc.", "layers.0.", "model.fc.",
                                                                           "model.layers.0."))}
    if hf.get("hidden_size") != tcfg.hidden_size or hf.get("vocab_size", tcfg.vocab_size) != tcfg.vocab_size:
        raise UserError(f"EAGLE checkpoint has hidden size {hf.get('hidden_size')} / vocabulary "
                        f"{hf.get('vocab_size')}; the target has {tcfg.hidden_size} / {tcfg.vocab_size}")
    cfg = draft_config(tcfg)
    model = EagleDraft(cfg, bias="fc.bias" in sd)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        raise UserError(f"EAGLE checkpoint {ck} does not fit: {' '.join(str(e).split())[:200]}") from None
    if missing:
        raise UserError(f"EAGLE checkpoint lacks {missing[:4]}")
    save_draft(model, Path(out_dir), target_engine)
    return Path(out_dir), "EAGLE-1/2 head"
