"""Decoder-only transformer for the Llama, Qwen2 and Gemma3 families, with a static KV cache.

One forward serves prefill, single-token decode and tree verification: it takes T new tokens, their
positions, the cache slots they are written to, and a boolean mask [T, S] over the first S cache slots
(True = may attend). Tree verification passes an ancestor mask; decode and prefill pass a causal one.
Weight names follow the Hugging Face layout without the `model.` prefix, so engines and official EAGLE
checkpoints load with plain `load_state_dict`.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


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
        return cls(**{k: v for k, v in json.loads(Path(path).read_text()).items() if k in cls.__dataclass_fields__})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.eps, self.offset = eps, 1.0 if gemma else 0.0  # Gemma stores w and scales by (1 + w)
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)


def rope_tables(cfg: ModelConfig, theta: float, scale: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device=device) / cfg.head_dim)
    t = torch.arange(cfg.max_seq_len, dtype=torch.float64, device=device) / scale
    ang = torch.outer(t, inv)
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos/sin [T, D/2]; rotate-half convention (as HF checkpoints are laid out)
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.h, self.kv, self.d = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        if cfg.gemma:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, gemma=True)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, gemma=True)

    def forward(self, x, cos, sin, slots, mask, k_cache, v_cache):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.h, self.d)
        k = self.k_proj(x).view(T, self.kv, self.d)
        v = self.v_proj(x).view(T, self.kv, self.d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache.index_copy_(1, slots, k.transpose(0, 1))
        v_cache.index_copy_(1, slots, v.transpose(0, 1))
        S = mask.shape[1]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k_cache[:, :S], v_cache[:, :S], attn_mask=mask,
                                           scale=self.scale, enable_gqa=True)
        return self.o_proj(o.transpose(0, 1).reshape(T, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = (lambda g: F.gelu(g, approximate="tanh")) if cfg.gemma else F.silu

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One decoder layer. EAGLE's draft layer is the same block with its input norm skipped."""

    def __init__(self, cfg: ModelConfig, skip_input_norm: bool = False):
        super().__init__()
        eps, g = cfg.rms_norm_eps, cfg.gemma
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        if not skip_input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        if g:  # Gemma normalises both sides of each sub-layer
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, g)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, g)

    def forward(self, x, cos, sin, slots, mask, k_cache, v_cache):
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        a = self.self_attn(h, cos, sin, slots, mask, k_cache, v_cache)
        if hasattr(self, "pre_feedforward_layernorm"):
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Static cache for one sequence: [layers, kv_heads, max_seq, head_dim] plus the position of each slot."""

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, device):
        shape = (num_layers, cfg.num_kv_heads, cfg.max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = torch.zeros(cfg.max_seq_len, dtype=torch.long, device=device)  # for sliding windows

    def write_pos(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.pos.index_copy_(0, slots, positions)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst (both [n]); used to compact the accepted path of a verified tree."""
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]
        self.pos[dst] = self.pos[src]


def layer_masks(cfg: ModelConfig, mask: torch.Tensor, positions: torch.Tensor, cache: KVCache):
    """The float additive masks for full and (Gemma) sliding layers from the caller's boolean mask."""
    neg = torch.finfo(cache.k.dtype).min
    full = torch.zeros(mask.shape, dtype=cache.k.dtype, device=mask.device).masked_fill(~mask, neg)
    if not cfg.sliding_window:
        return full, full
    near = (positions[:, None] - cache.pos[None, : mask.shape[1]]) < cfg.sliding_window
    local = torch.zeros_like(full).masked_fill(~(mask & near), neg)
    return full, local


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cache: KVCache | None = None

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
        x = self.embed_tokens(tokens)
        if self.embed_scale != 1.0:  # Gemma scales embeddings by sqrt(d) in the weights' dtype
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def forward(self, tokens, positions, slots, mask) -> torch.Tensor:
        """tokens/positions/slots [T] long, mask [T, S] bool -> final-normed hidden states [T, d]."""
        c, cache = self.cfg, self.cache
        cache.write_pos(slots, positions)
        full, local = layer_masks(c, mask, positions, cache)
        g = (self.rope_global[0][positions], self.rope_global[1][positions])
        lo = (self.rope_local[0][positions], self.rope_local[1][positions])
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            sliding = c.is_sliding(i)
            cos, sin = lo if sliding else g
            x = layer(x, cos, sin, slots, local if sliding else full, cache.k[i], cache.v[i])
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight)
