"""Decoder-only transformer for the Llama, Qwen2 and Gemma3 families, with a (paged) KV cache.

One forward serves prefill, single-token decode and tree verification, for one request or a batch of B
requests with T rows each: it takes the new tokens, their positions, the cache slots they are written to, and
a `Span`: per request the committed slots every row sees, a boolean mask over the new slots (an ancestor mask
for tree verification, a causal one for decode and prefill), and the block table that places the request's
slots in the shared pool; or `Spans`, several of them over consecutive rows (the batched engine's step: prefill
chunks and decode rows in one pass). The layer's pieces (add + RMSNorm, rotary + cache write, gated activation,
attention, the projections) are plugins/layers.py: plain torch on the CPU and under autograd, Triton kernels on
CUDA; q|k|v and gate|up are one GEMM each, each with the add + RMSNorm before it in one call (layers.norm_linear),
and the gated activation rides in the down projection's call.
Weight names follow the Hugging Face layout without the `model.` prefix, so engines and official EAGLE
checkpoints load with plain `load_state_dict`.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import nn

from plugins import layers
from plugins.layers import KV_BLOCK, Span, Spans

from .. import parallel


@dataclass
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling_factor: float = 1.0  # linear position scaling (global layers), 1.0 = none
    # Gemma3: local layers use a sliding window and their own rope base.
    sliding_window: int = 0
    rope_local_theta: float = 10000.0
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" | "full_attention"
    query_pre_attn_scalar: float = 0.0
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    dtype: str = "bfloat16"  # storage dtype of the engine weights

    @property
    def gemma(self) -> bool:
        return self.arch == "gemma3"

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        """ValueError naming what is wrong: not JSON, not an object, or the keys it lacks."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object of model settings")
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING
                   and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.eps, self.offset = eps, 1.0 if gemma else 0.0  # Gemma stores w and scales by (1 + w)
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layers.rms_norm(x, self.weight, self.eps, self.offset)


def rope_tables(cfg: ModelConfig, theta: float, scale: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device=device) / cfg.head_dim)
    t = torch.arange(cfg.max_seq_len, dtype=torch.float64, device=device) / scale
    ang = torch.outer(t, inv)
    return torch.cos(ang).float(), torch.sin(ang).float()


class FusedLinear(nn.Linear):
    """One GEMM for several projections of the same input (q|k|v, gate|up). Checkpoints keep the parts as
    separate tensors (the Hugging Face and EAGLE layouts): `fuse_parts` makes the owning module concatenate them
    on load and split them on save."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts


def fuse_parts(owner: nn.Module, name: str) -> None:
    """Hooks on `owner` (they must see the part names before the owner's loader calls them unexpected)."""
    parts = getattr(owner, name).parts

    def fuse(module, sd, prefix, *args):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{p}.{kind}" for p in parts]
            if all(k in sd for k in keys):
                sd[f"{prefix}{name}.{kind}"] = torch.cat([sd.pop(k) for k in keys])

    def split(module, sd, prefix, *args):
        for kind in ("weight", "bias"):
            fused = sd.pop(f"{prefix}{name}.{kind}", None)
            if fused is not None:
                for p, part in zip(parts, fused.split(list(parts.values()))):
                    sd[f"{prefix}{p}.{kind}"] = part

    owner.register_load_state_dict_pre_hook(fuse)
    owner._register_state_dict_hook(split)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: bool = False, in_features: int | None = None):
        """in_features: the width q|k|v read (EAGLE-3's draft layer reads [embedding ; hidden], 2 x hidden)."""
        super().__init__()
        self.reduce = reduce  # tensor parallel: cfg holds this rank's heads, o_proj its input columns
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.h, self.kv, self.d, self.eps = h, kv, d, cfg.rms_norm_eps
        self.qkv_proj = FusedLinear(in_features or cfg.hidden_size,
                                    {"q_proj": h * d, "k_proj": kv * d, "v_proj": kv * d}, bias=cfg.attention_bias)
        fuse_parts(self, "qkv_proj")
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        if cfg.gemma:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, gemma=True)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, gemma=True)

    def rope_args(self, rope, positions, slots, span, k_pos, window, k_cache, v_cache) -> tuple:
        """layers.rope_cache_write's arguments after qkv, from the block's attention arguments."""
        qk_norm = (self.q_norm.weight, self.k_norm.weight) if hasattr(self, "q_norm") else None
        return self.h, self.kv, rope, positions, slots, k_cache, v_cache, qk_norm, self.eps

    def forward(self, q, rope, positions, slots, span, k_pos, window, k_cache, v_cache):
        """q: rotated, k and v written (the block runs q|k|v with the norm before it and the rotation after it,
        layers.norm_linear)."""
        o = layers.attention(q, k_cache, v_cache, span, positions, k_pos, window, self.scale)
        o = layers.linear(o.reshape(q.shape[0], self.h * self.d), self.o_proj.weight)
        return parallel.all_reduce(o) if self.reduce else o


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: bool = False):
        super().__init__()
        self.reduce = reduce  # tensor parallel: this rank's gate|up columns, down_proj's matching input columns
        i = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate_proj": i, "up_proj": i}, bias=False)
        fuse_parts(self, "gate_up_proj")
        self.down_proj = nn.Linear(i, cfg.hidden_size, bias=False)
        self.gelu = cfg.gemma

    def forward(self, gate_up):
        """gate_up: the output of gate_up_proj (the block runs it, with the norm before it in its prologue)."""
        y = layers.linear(gate_up, self.down_proj.weight, act="gelu" if self.gelu else "silu")  # act_mul folded in
        return parallel.all_reduce(y) if self.reduce else y


class Block(nn.Module):
    """One decoder layer. It takes the residual stream as (res, delta): its input is res + delta, where delta
    is the previous layer's MLP output (normed by that layer's post-feedforward norm on Gemma, `delta_norm`),
    so each add is fused with the norm after it. Returns (res, delta) for the next layer. EAGLE's draft layer
    is the same block with its input norm skipped."""

    def __init__(self, cfg: ModelConfig, skip_input_norm: bool = False, reduce: bool = False):
        super().__init__()
        eps, g = cfg.rms_norm_eps, cfg.gemma
        self.self_attn = Attention(cfg, reduce)
        self.mlp = MLP(cfg, reduce)
        if not skip_input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        if g:  # Gemma normalises both sides of each sub-layer
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, g)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, g)

    @property
    def out_norm(self) -> torch.Tensor | None:
        """The norm applied to this layer's delta before it is added (Gemma's post-feedforward norm)."""
        n = getattr(self, "post_feedforward_layernorm", None)
        return None if n is None else n.weight

    def forward(self, res, delta, delta_norm, attn_args):
        """Each add + RMSNorm runs with the projection after it, and q|k|v with the rotation + KV write after it
        (layers.norm_linear: in the skinny GEMM's prologue / epilogue where that measured faster; Gemma's delta,
        normed first, takes add_rms_norm + the projection, its q/k norms rope_cache_write)."""
        norm, at, mlp = self.post_attention_layernorm, self.self_attn, self.mlp
        rope = at.rope_args(*attn_args)
        if hasattr(self, "input_layernorm"):
            res, q = layers.norm_linear(res, delta, self.input_layernorm.weight, norm.eps, norm.offset,
                                        at.qkv_proj.weight, at.qkv_proj.bias, delta_norm, rope)
        else:  # the draft layer: its input is the fc output, unnormed
            q = layers.rope_cache_write(layers.linear(res, at.qkv_proj.weight, at.qkv_proj.bias), *rope)
        a = at(q, *attn_args)
        gemma = hasattr(self, "pre_feedforward_layernorm")  # a is normed by the post-attention norm first
        res, gate_up = layers.norm_linear(res, a, (self.pre_feedforward_layernorm if gemma else norm).weight,
                                          norm.eps, norm.offset, mlp.gate_up_proj.weight, None,
                                          norm.weight if gemma else None)
        return res, mlp(gate_up)


class KVCache:
    """A pool of cache slots [layers, kv_heads, slots, head_dim] plus the position held by each slot (for sliding
    windows). One sequence (slots = max_seq_len, its logical slots are physical) or, paged, the blocks of every
    running request (engine/block_manager.py hands them out; a Span's block table maps a request's slots)."""

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, device, slots: int | None = None):
        slots = slots or -(-cfg.max_seq_len // KV_BLOCK) * KV_BLOCK  # whole blocks: the identity table's reach
        shape = (num_layers, cfg.num_kv_heads, slots, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = torch.zeros(slots, dtype=torch.long, device=device)
        # only a sliding-window layer reads the slots' positions (attention's k_pos): without one they are never
        # written, which saves a kernel per forward and two per KV move (a draft round runs ~8 forwards)
        self.windowed = bool(cfg.sliding_window)

    def write_pos(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        if self.windowed:
            self.pos.index_copy_(0, slots, positions)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy physical slots src -> dst (both [n], or [B, P]: one request a row); used to compact the accepted
        path of a verified tree."""
        layers.move_slots(self.k, self.v, src, dst)
        if self.windowed:
            self.pos[dst] = self.pos[src]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        """Under tensor parallelism cfg is this rank's shard (parallel.shard_config) and the embedding and LM head
        hold the rows of parallel.vocab_range."""
        super().__init__()
        self.cfg = cfg
        tp = parallel.world() > 1
        self.vocab_start, vocab_end = parallel.vocab_range(cfg.vocab_size)
        self.embed_tokens = nn.Embedding(vocab_end - self.vocab_start, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, reduce=tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, vocab_end - self.vocab_start, bias=False)
        self.cache: KVCache | None = None
        self.full_head: torch.Tensor | None = None  # TP: all V head rows, for the draft vocabulary (loader)
        # EAGLE-3: the layers whose input residual stream every forward also keeps, concatenated in layer order
        # into `tapped` [rows, len(taps) x d] (index num_layers: the last layer's output, before the final norm)
        self.taps: tuple[int, ...] = ()
        self.tapped: torch.Tensor | None = None

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def setup(self, dtype, device) -> "Transformer":
        """Move to device/dtype, build rope tables and the static KV cache."""
        self.to(device=device, dtype=dtype).requires_grad_(False)  # inference; training re-enables
        c = self.cfg
        self.rope_global = rope_tables(c, c.rope_theta, c.rope_scaling_factor, device)
        self.rope_local = rope_tables(c, c.rope_local_theta, 1.0, device) if c.sliding_window else self.rope_global
        self.cache = KVCache(c, c.num_layers, dtype, device)
        self.embed_scale = math.sqrt(c.hidden_size) if c.gemma else 1.0
        return self

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if parallel.world() == 1:
            x = self.embed_tokens(tokens)
        else:  # this rank's rows, zeros for the ids other ranks hold, summed (exact: one non-zero term per row)
            local = tokens - self.vocab_start
            mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
            x = parallel.all_reduce(self.embed_tokens(local.where(mine, 0)).masked_fill(~mine[:, None], 0))
        if self.embed_scale != 1.0:  # Gemma scales embeddings by sqrt(d) in the weights' dtype
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def forward(self, tokens, positions, slots, span: Span | Spans, cache: KVCache | None = None) -> torch.Tensor:
        """tokens/positions/slots [B * T] long (slots: each request's own, logical), attending as `span` says ->
        final-normed hidden states [B * T, d]. `cache`: a paged pool instead of the single-sequence cache."""
        c, cache = self.cfg, cache or self.cache
        slots = span.physical(slots)
        cache.write_pos(slots, positions)
        res, delta, delta_norm = self.embed(tokens), None, None
        taps = []
        for i, layer in enumerate(self.layers):
            if i in self.taps:
                taps.append(self._stream(res, delta, delta_norm))
            sliding = c.is_sliding(i)
            rope, window = (self.rope_local, c.sliding_window) if sliding else (self.rope_global, 0)
            attn_args = (rope, positions, slots, span, cache.pos, window, cache.k[i], cache.v[i])
            res, delta = layer(res, delta, delta_norm, attn_args)
            delta_norm = layer.out_norm
        if self.taps:
            if c.num_layers in self.taps:
                taps.append(self._stream(res, delta, delta_norm))
            self.tapped = torch.cat(taps, -1)
        return layers.add_rms_norm(res, delta, self.norm.weight, self.norm.eps, self.norm.offset, delta_norm)[1]

    def _stream(self, res, delta, delta_norm) -> torch.Tensor:
        """The residual stream res + delta that the next layer reads (delta normed first on Gemma)."""
        if delta is None:
            return res
        if delta_norm is not None:
            delta = layers.rms_norm(delta, delta_norm, self.norm.eps, self.norm.offset)
        return res + delta

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, V]; under TP this rank's vocabulary slice [T, V / tp]: reduce it with `argmax` / `topk`."""
        return layers.linear(hidden, self.head_weight)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The id of each row's largest logit [T]."""
        return layers.vocab_argmax(logits) if parallel.world() == 1 else parallel.argmax(logits, self.vocab_start)

    def topk(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """The ids of each row's k largest logits [T, k], largest first."""
        return layers.vocab_topk(logits, k)[1] if parallel.world() == 1 else parallel.topk(logits, k, self.vocab_start)
