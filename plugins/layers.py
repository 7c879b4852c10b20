"""The decoder layer's fused pieces: residual add + RMSNorm, rotary + KV-cache write, gated activation, and
attention over a `Span`. Each function here is the plain-torch reference (the CPU path, training under autograd,
and what the checks compare against); on CUDA, outside autograd, it calls the Triton kernel of
plugins/triton_layers.py instead, one launch per call (attention: one, plus a split combine for long spans).
MICROSPEC_PLUGINS=torch keeps the reference everywhere (A/B runs)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

_FAST = None  # Triton importable and not switched off (decided on first use)
_FORCE: bool | None = None  # set by `path()`: the checks run one path whatever the device


def fast(*tensors: torch.Tensor | None) -> bool:
    """Use the Triton kernels for this call: CUDA tensors that autograd does not track, Triton importable."""
    global _FAST
    if _FORCE is not None:
        return _FORCE
    ts = [t for t in tensors if t is not None]
    if not ts[0].is_cuda or (torch.is_grad_enabled() and any(t.requires_grad for t in ts)):
        return False
    if _FAST is None:
        try:
            from . import triton_layers  # noqa: F401  (imports triton)
            _FAST = os.environ.get("MICROSPEC_PLUGINS", "auto") != "torch"
        except ImportError:
            _FAST = False
    return _FAST


@contextmanager
def path(use_triton: bool):
    """Run every layer op on the Triton kernels (True) or the torch reference (False) inside the block; with
    TRITON_INTERPRET=1 the kernels run on CPU tensors too (the CPU tests of the kernels)."""
    global _FORCE
    old, _FORCE = _FORCE, use_triton
    try:
        yield
    finally:
        _FORCE = old


@dataclass
class Span:
    """What T new tokens attend to: the n committed cache slots, then the m slots n .. n+m-1 being written now,
    as the bool mask `new` [T, m] says. The T rows are the last T of those m slots, in order, and a row sees no
    new slot after its own (causal, tree and draft-expansion masks all are so). S is a static upper bound on the
    slots read (a CUDA graph's bucket), n a device scalar, so one captured step serves every n."""
    n: torch.Tensor  # 0-d long
    new: torch.Tensor  # [T, m] bool
    S: int
    _masks: dict = field(default_factory=dict, repr=False)  # the reference's [T, S] masks, built once per forward

    def mask(self, window: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[T, S] bool (True = may attend), cut to `window` positions back when window > 0 (reference path)."""
        if window not in self._masks:
            t, m = self.new.shape
            dev = self.new.device
            mask = (torch.arange(self.S, device=dev) < self.n).expand(t, self.S).clone()
            mask[:, self.n + torch.arange(m, device=dev)] = self.new
            if window:
                mask &= (q_pos[:, None] - k_pos[None, : self.S]) < window
            self._masks[window] = mask
        return self._masks[window]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + w.float())).to(x.dtype)


def add_rms_norm(res: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float, offset: float,
                 delta_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """res + delta (delta first normed by delta_w: Gemma's post-norms), and the RMSNorm of that sum by w.
    Returns (new residual, normed). delta None: just the norm of res."""
    if fast(res, delta, w, delta_w):
        from .triton_layers import add_rms_norm as kernel
        return kernel(res, delta, w, eps, offset, delta_w)
    if delta is not None:
        res = res + (rms_norm(delta, delta_w, eps, offset) if delta_w is not None else delta)
    return res, rms_norm(res, w, eps, offset)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos/sin [T, D/2]; rotate-half convention (as HF checkpoints are laid out)
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_cache_write(qkv: torch.Tensor, heads: int, kv_heads: int, rope: tuple[torch.Tensor, torch.Tensor],
                     positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     qk_norm: tuple[torch.Tensor, torch.Tensor] | None, eps: float) -> torch.Tensor:
    """qkv [T, (H + 2 KV) * D] from the fused projection -> rotated q [T, H, D]; rotated k and v written into the
    caches [KV, S_max, D] at `slots`. qk_norm: Gemma's per-head (1 + w) RMSNorm of q and k, before the rotation."""
    if fast(qkv, *(qk_norm or ())):
        from .triton_layers import rope_cache_write as kernel
        return kernel(qkv, heads, kv_heads, rope, positions, slots, k_cache, v_cache, qk_norm, eps)
    T, D = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.view(T, heads + 2 * kv_heads, D).split([heads, kv_heads, kv_heads], dim=1)
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], eps, 1.0), rms_norm(k, qk_norm[1], eps, 1.0)
    cos, sin = rope[0][positions], rope[1][positions]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k_cache.index_copy_(1, slots, k.transpose(0, 1))
    v_cache.index_copy_(1, slots, v.transpose(0, 1))
    return q


def act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up [T, I]; SiLU (Llama, Qwen2) or tanh-GELU (Gemma)."""
    if fast(gate_up):
        from .triton_layers import act_mul as kernel
        return kernel(gate_up, gelu)
    g, u = gate_up.chunk(2, dim=-1)
    return (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: Span, q_pos: torch.Tensor,
              k_pos: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q [T, H, D] over the caches [KV, S_max, D] (GQA: q head h reads kv head h // (H / KV)) as `span` says,
    keys at most window - 1 positions back when window > 0 -> [T, H, D]."""
    if fast(q, k_cache, v_cache):
        from .triton_layers import attention as kernel
        return kernel(q, k_cache, v_cache, span, q_pos, k_pos, window, scale)
    S = span.S
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k_cache[:, :S], v_cache[:, :S],
                                       attn_mask=span.mask(window, q_pos, k_pos), scale=scale, enable_gqa=True)
    return o.transpose(0, 1)
