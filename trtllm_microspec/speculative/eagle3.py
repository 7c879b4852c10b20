"""EAGLE-3 draft head, and the checkpoint layouts users bring (SafeAILab EAGLE, SpecForge, vLLM speculators).

The head, as all three sources define it (SafeAILab eagle/model/cnets.py, SpecForge's LlamaForCausalLMEagle3,
vLLM's llama_eagle3.py / speculators' Eagle3 draft):
  feature  = fc(concat of the target's residual streams at three layers: low, mid, high) [3 x target hidden -> d];
             at later draft steps the draft's own previous output instead (vLLM's rule: fc only when the width is
             not d)
  layer    one Llama decoder layer whose attention reads [input_layernorm(embed(token)) ; hidden_norm(feature)]
           (2 x d), residual = the feature (speculators' norm_before_residual: the normed feature), then
           post_attention_layernorm + MLP
  output   the layer's output before any norm: it is the next step's feature; the draft's logits are
           lm_head(norm(output)) over its own draft vocabulary of draft_vocab_size ids, draft id i being target id
           i + d2t[i] (t2d marks the target ids that have a draft id)
The three layers are the inputs of target layers (2, L // 2, L - 3) unless the checkpoint says otherwise (taps_of:
vLLM's top-level `eagle_aux_hidden_state_layer_ids` name the residual stream entering a layer, SpecForge's
`eagle_config` ones the layer whose output it is); the target keeps them in every forward, CUDA graphs included
(Transformer.taps).

Beside EagleDraft (speculative/eagle.py) it offers the same narrow interface the engines call: hidden(), features()
(what the target hands the draft), head_in() (the draft hidden -> the LM head's input) and vocab_rows() (the LM
head's rows and the target id of each, for the draft vocabularies of vocab/).

Draft engine directory: config.json (a ModelConfig of the layer plus `eagle: 3`, `target_hidden_size`,
`draft_vocab_size`, `taps`, `norm_before_residual`, `layout`, `target`) and model.safetensors with `fc.*`,
`layers.0.*`, `norm.weight`, `lm_head.weight`, `d2t` (and `embed_tokens.weight` when the head's embedding is not the
target's).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from plugins import layers

from .. import parallel
from ..models.model import MLP, Attention, KVCache, ModelConfig, RMSNorm, Span, Transformer, rope_tables
from ..models.registry import UserError

LAYOUTS = ("SafeAILab EAGLE-3", "SpecForge EAGLE-3", "speculators (vLLM) EAGLE-3")
# transformers' LlamaConfig defaults: speculators writes its layer config with to_diff_dict, which leaves them out
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
                  "attention_bias": False, "hidden_act": "silu"}


def default_taps(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high layers (SafeAILab, SpecForge and vLLM alike)."""
    return [2, num_layers // 2, num_layers - 3]


def taps_of(hf: dict, num_layers: int, where: str) -> list[int]:
    """The target layers a checkpoint's head reads, as Transformer.taps numbers them (i: the residual stream
    entering layer i, 0 the embedding output, num_layers the last layer's output before the final norm; no final
    norm on any), from its config.json. The two keys count differently:
    - top-level `eagle_aux_hidden_state_layer_ids` (vLLM, speculators): vLLM's own numbering, ours (its llama.py
      keeps hidden_states + residual before layer i; speculators' datagen captures with vLLM), read as is;
    - `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge): the decoder layer whose OUTPUT is taken
      (SpecForge's forward hook on layers[i]; sglang's set_eagle3_layers_to_capture adds 1), so i + 1 here.
    Neither: EAGLE-3's default, the inputs of layers (2, L // 2, L - 3) (SafeAILab's modeling_llama_kv.py; SpecForge's
    [1, L // 2 - 1, L - 4] outputs; vLLM's and speculators' default), read low to high."""
    top = hf.get("eagle_aux_hidden_state_layer_ids")
    nested = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    taps = list(top) if top else [i + 1 for i in nested] if nested else default_taps(num_layers)
    if len(taps) != 3 or min(taps) < 0 or max(taps) > num_layers:
        raise UserError(f"{where} reads target layers {top or nested}; this target has {num_layers} layers")
    if taps != sorted(set(taps)):  # fc's columns are low, mid, high: the order the target keeps them in
        raise UserError(f"{where} reads target layers {top or nested}, not in increasing order: not supported")
    return taps


def draft3_config(target: ModelConfig) -> ModelConfig:
    """A head of the target's shapes as SpecForge configures one: a plain Llama layer (no q/k/v bias, no sliding
    window, SiLU), for a random or a newly trained head."""
    return ModelConfig(**{**target.__dict__, "arch": "llama", "num_layers": 1, "layer_types": [], "sliding_window": 0,
                          "attention_bias": False, "query_pre_attn_scalar": 0.0})


def random_head(engine: Path, out: Path, draft_vocab: int, seed: int = 0) -> Path:
    """A randomly initialised EAGLE-3 head over `draft_vocab` random ids of the engine's target (losslessness must
    hold for any head): benchmarks/gpu_reproduce.sh's eagle3-lossless stage."""
    t = ModelConfig.load(Path(engine) / "config.json")
    torch.manual_seed(seed)
    model = Eagle3Draft(draft3_config(t), t.hidden_size, draft_vocab, default_taps(t.num_layers))
    ids = torch.randperm(t.vocab_size)[:draft_vocab].sort().values
    model.d2t.copy_(ids - torch.arange(draft_vocab))
    save_draft3(model, out, {"arch": t.arch, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size}, "random")
    return Path(out)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.self_attn = Attention(cfg, in_features=2 * d)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(d, eps, gemma=False)
        self.hidden_norm = RMSNorm(d, eps, gemma=False)
        self.post_attention_layernorm = RMSNorm(d, eps, gemma=False)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, attn_args, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] the feature, emb [T, d] the tokens' embeddings (with tokens [T]: the table they index)."""
        at, mlp, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        # both inputs normed side by side in one launch, the embeddings gathered in it (both norms take the
        # config's eps); then the layer runs its projections and the rotation + KV write (Attention takes the
        # rotated q, MLP gate|up), as models/model.py's Block does
        xin = layers.norm_cat(emb, x, self.input_layernorm.weight, self.hidden_norm.weight, self.hidden_norm.eps,
                              tokens)
        qkv = layers.linear(xin, at.qkv_proj.weight, at.qkv_proj.bias)
        a = at(layers.rope_cache_write(qkv, *at.rope_args(*attn_args)), *attn_args)
        res = xin[..., x.shape[-1]:].contiguous() if self.norm_before_residual else x  # the normed feature
        res, gate_up = layers.norm_linear(res, a, norm.weight, norm.eps, norm.offset, mlp.gate_up_proj.weight, None)
        return res + mlp(gate_up)


class Eagle3Draft(nn.Module):
    version = 3

    def __init__(self, cfg: ModelConfig, target_hidden: int, draft_vocab: int, taps: list[int],
                 norm_before_residual: bool = False, own_embed: bool = False):
        super().__init__()
        self.cfg, self.target_hidden, self.taps = cfg, target_hidden, sorted(taps)
        self.norm_before_residual = norm_before_residual
        d = cfg.hidden_size
        self.fc = nn.Linear(len(taps) * target_hidden, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, norm_before_residual)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, gemma=False)
        self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # draft id i -> target id i + d2t[i]
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, d)

    def setup(self, target: Transformer, dtype, device) -> "Eagle3Draft":
        self.to(device=device, dtype=dtype).requires_grad_(False)  # casts the weights, not d2t (integer)
        self.target = [target]  # a list, so the target is not registered as a sub-module
        target.taps = tuple(self.taps)
        self.rope = rope_tables(self.cfg, self.cfg.rope_theta, self.cfg.rope_scaling_factor, device)
        self.head_ids = torch.arange(self.d2t.numel(), device=device) + self.d2t
        return self  # no KV cache of its own: the caller's (the batched engine's paged pool) comes with each call

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """The target's forward that produced h [..., d] -> the draft's input there: its three layers [..., 3 d]."""
        return self.target[0].tapped.view(*h.shape[:-1], -1)

    def head_in(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def vocab_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM head's rows [draft_vocab, d] and the target id of each [draft_vocab]."""
        return self.lm_head.weight, self.head_ids

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens(tokens)
        return self.target[0].embed(tokens)

    def embed_table(self) -> torch.Tensor | None:
        """The rows embed() takes a token's from, where it is a plain row lookup (the head's own table, or the
        target's unsharded and unscaled one), so the layer can gather them itself; else None."""
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens.weight
        t = self.target[0]
        return t.embed_tokens.weight if parallel.world() == 1 and t.embed_scale == 1.0 else None

    def hidden(self, tokens, features, positions, slots, span: Span, cache: KVCache) -> torch.Tensor:
        """tokens [T] (token t+1), features [T, 3 x target d] (the target's layers at t) or [T, d] (the draft's
        output at t) -> the draft's output [T, d] (before its norm: the next step's feature); K and V go into
        cache (shaped by self.cfg)."""
        slots = span.physical(slots)
        cache.write_pos(slots, positions)
        x = features.to(self.fc.weight.dtype)
        if x.shape[-1] != self.cfg.hidden_size:
            x = layers.linear(x, self.fc.weight)
        attn_args = (self.rope, positions, slots, span, cache.pos, 0, cache.k[0], cache.v[0])
        table = self.embed_table()
        if table is not None:  # the embeddings gathered in the layer's input-norm launch
            return self.layers[0](x, table, attn_args, tokens)
        return self.layers[0](x, self.embed(tokens), attn_args)


def save_draft3(model: Eagle3Draft, out_dir: Path, target_record: dict, layout: str) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().contiguous()
          for k, v in model.state_dict().items()}
    save_file(sd, out_dir / "model.safetensors")
    cfg = {**model.cfg.__dict__, "eagle": 3, "target_hidden_size": model.target_hidden,
           "draft_vocab_size": model.lm_head.out_features, "taps": model.taps,
           "norm_before_residual": model.norm_before_residual, "layout": layout, "target": target_record}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_draft3(raw: dict, sd: dict, target: Transformer) -> Eagle3Draft:
    """A draft directory's config and weights (speculative/eagle.py load_draft read them) -> the head, on the meta
    device until setup."""
    t = target.cfg
    if raw.get("target_hidden_size") != t.hidden_size or raw.get("vocab_size") != t.vocab_size \
            or max(raw.get("taps", [t.num_layers + 1])) > t.num_layers:
        raise UserError(f"EAGLE-3 draft was built for hidden size {raw.get('target_hidden_size')} / vocabulary "
                        f"{raw.get('vocab_size')} / layers {raw.get('taps')}, but the target has {t.hidden_size} / "
                        f"{t.vocab_size} / {t.num_layers} layers")
    cfg = ModelConfig(**{k: v for k, v in raw.items() if k in ModelConfig.__dataclass_fields__})
    with torch.device("meta"):
        model = Eagle3Draft(cfg, raw["target_hidden_size"], raw["draft_vocab_size"], raw["taps"],
                            bool(raw.get("norm_before_residual")), own_embed="embed_tokens.weight" in sd)
    model.load_state_dict(sd, strict=True, assign=True)
    return model


# ---------------------------------------------------------------------------------------------------------------
# checkpoints as their sources write them

def is_eagle3(hf: dict, sd: dict) -> bool:
    return ("d2t" in sd or any(k.startswith("midlayer.") for k in sd) or "draft_vocab_size" in hf
            or hf.get("speculators_model_type") == "eagle3")


def layout_of(hf: dict) -> str:
    if "speculators_model_type" in hf or "transformer_layer_config" in hf:
        return LAYOUTS[2]
    if any("Eagle3" in a for a in hf.get("architectures") or []):
        return LAYOUTS[1]
    return LAYOUTS[0]


def convert(hf: dict, sd: dict, tcfg: ModelConfig, target_embed, layout: str) -> Eagle3Draft:
    """An EAGLE-3 checkpoint's config.json and weights (any layout) -> the head, checked against the target.
    target_embed(): the target's embedding weight, read only when the checkpoint carries its own (SpecForge
    saves a copy of the target's: then it is dropped)."""
    where = f"{layout} checkpoint"
    if layout == LAYOUTS[2]:
        if hf.get("speculators_model_type", "eagle3") != "eagle3":
            raise UserError(f"{where} is a {hf['speculators_model_type']!r} speculator, not eagle3")
        layer = {**LLAMA_DEFAULTS, **(hf.get("transformer_layer_config") or {})}
        nbr = bool(hf.get("norm_before_residual", False))
    else:
        layer, nbr = {**LLAMA_DEFAULTS, **hf}, bool(hf.get("norm_before_residual", False))
    if hf.get("norm_before_fc") or "input_norm.weight" in sd:
        raise UserError(f"{where} normalises the features before fc (norm_before_fc), which is not supported")
    # norm_output: SpecForge's (default true) normalises before lm_head, as we do; speculators' (default false,
    # "Eagle 3.1") also feeds the normed output to the next step
    if bool(hf.get("norm_output", layout != LAYOUTS[2])) != (layout != LAYOUTS[2]):
        raise UserError(f"{where} sets norm_output {hf['norm_output']}, which is not supported")
    eagle_cfg = hf.get("eagle_config") or {}
    if eagle_cfg.get("use_aux_hidden_state") is False:
        raise UserError(f"{where} reads the target's last layer only (use_aux_hidden_state false), not supported")
    sd = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    d = layer["hidden_size"]
    fc = sd.get("fc.weight")
    # the target's hidden size: the config's, else what fc reads (three layers), else the draft's own
    th = hf.get("target_hidden_size") or (fc.shape[1] // 3 if fc is not None and fc.dim() == 2 else d)
    V = layer["vocab_size"]
    Vd = hf.get("draft_vocab_size") or V
    if V != tcfg.vocab_size or th != tcfg.hidden_size:
        raise UserError(f"{where} is for a target of hidden size {th} / vocabulary {V}; this target has "
                        f"{tcfg.hidden_size} / {tcfg.vocab_size}")
    taps = taps_of(hf, tcfg.num_layers, where)
    if layer.get("num_hidden_layers", 1) != 1 or any(k.startswith("layers.1.") for k in sd):
        raise UserError(f"{where} has {layer.get('num_hidden_layers')} decoder layers; supported: 1")
    if layer.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where} uses activation {layer['hidden_act']!r}; supported: silu")
    if 3 * th == d:
        raise UserError(f"{where}: 3 x target hidden size equals the draft's ({d}): fc could not be told apart")
    heads = layer["num_attention_heads"]
    rope = layer.get("rope_scaling") or {}
    scale = float(rope.get("factor", 1.0)) if rope.get("rope_type", rope.get("type")) == "linear" else 1.0
    cfg = ModelConfig(arch="llama", vocab_size=V, hidden_size=d, intermediate_size=layer["intermediate_size"],
                      num_layers=1, num_heads=heads, num_kv_heads=layer.get("num_key_value_heads") or heads,
                      head_dim=layer.get("head_dim") or d // heads, rms_norm_eps=layer["rms_norm_eps"],
                      rope_theta=layer["rope_theta"], max_seq_len=tcfg.max_seq_len, tie_word_embeddings=False,
                      attention_bias=bool(layer.get("attention_bias", False)), rope_scaling_factor=scale)
    embed = sd.pop("embed_tokens.weight", None)
    if embed is not None and embed.shape == (tcfg.vocab_size, tcfg.hidden_size):
        te = target_embed()
        if torch.equal(embed.to(te.dtype), te):
            embed = None  # the target's own embedding, frozen while training (SpecForge, speculators)
    if embed is None and d != tcfg.hidden_size:
        raise UserError(f"{where} has hidden size {d} but no embedding of its own (the target's is {tcfg.hidden_size})")
    t2d = sd.pop("t2d", None)
    d2t = sd.pop("d2t", torch.zeros(Vd, dtype=torch.long)).long()
    if d2t.shape != (Vd,):
        raise UserError(f"{where}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {Vd}")
    ids = torch.arange(Vd) + d2t
    if ids.min() < 0 or ids.max() >= V or ids.unique().numel() != Vd:
        raise UserError(f"{where}: d2t maps draft ids outside the target vocabulary or twice onto one id")
    if t2d is not None and (t2d.shape != (V,) or int(t2d.bool().sum()) != Vd or not t2d.bool()[ids].all()):
        raise UserError(f"{where}: t2d and d2t disagree on the draft vocabulary")
    model = Eagle3Draft(cfg, th, Vd, taps, nbr, own_embed=embed is not None)
    sd["d2t"] = d2t
    if embed is not None:
        sd["embed_tokens.weight"] = embed
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise UserError(f"{where} does not match EAGLE-3's weights: missing {missing[:4]}, unexpected "
                        f"{unexpected[:4]}")
    return model


def read_target_embed(engine: Path):
    """The engine's embedding weight, read alone (not the whole model)."""
    def read():
        with safe_open(Path(engine) / "model.safetensors", "pt") as f:
            return f.get_tensor("embed_tokens.weight")
    return read
