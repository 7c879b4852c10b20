"""The decoder layer's fused pieces: residual add + RMSNorm, rotary + KV-cache write, gated activation,
attention over a `Span`, and the projections (`linear`). Each function here is the plain-torch reference (the CPU
path, training under autograd, and what the checks compare against); on CUDA, outside autograd, it calls the
Triton kernel of plugins/triton_layers.py instead, one launch per call (attention: one, plus a split combine for
long spans; prefill spans of LONG_ROWS rows or more stay on the reference, whose SDPA is faster there; a causal
Spans, a batched step's prompt chunks and decode rows, one launch for all its parts). The
projections run their skinny GEMM only at 1-64 rows and only where it measured faster than cuBLAS for the shape
(`linear_choice`), so that default is never slower than F.linear; `norm_linear` folds the residual add + RMSNorm
into the next projection's skinny GEMM likewise only where that measured faster than the two calls.
MICROSPEC_PLUGINS=torch keeps the reference everywhere (A/B runs)."""
from __future__ import annotations

import functools
import os
import statistics
import warnings
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


LONG_ROWS = 512  # rows per request from which attention runs the reference: SDPA's flash kernels beat our
# split-K kernel on long prefill spans (H200, a 4,096-row packed prefill of qwen2.5-coder-1.5b: 41 vs 54 ms, when SDPA
# still ran its math kernel there)
KV_BLOCK = 32  # slots per block of a paged KV cache (the block table's unit)


@dataclass
class Span:
    """What the rows of a batch of B requests attend to. The rows are B * T, request by request; request b's
    T rows see its n[b] committed slots, then the slots n[b] .. n[b]+m-1 being written now, as its mask
    new[b] [T, m] says. The T rows are the last T of those m slots, in order, and a row sees no new slot after
    its own (causal, tree and draft-expansion masks all are so): the kernel relies on it to stop early.
    Slots are a request's own (logical); slot s of request b lives at slot
    block_table[b, s // KV_BLOCK] * KV_BLOCK + s % KV_BLOCK of the shared cache pool (physical). S is a static
    upper bound on the logical slots read (a CUDA graph's bucket), n a device tensor, so one captured step
    serves every n. A 0-d n, a [T, m] mask and no table is one request whose logical slots are physical."""
    n: torch.Tensor  # [B] long (0-d: B = 1)
    new: torch.Tensor  # [B, T, m] bool ([T, m]: B = 1)
    S: int
    block_table: torch.Tensor | None = None  # [B, blocks] long, blocks * KV_BLOCK >= S; None: the identity
    # the rows' physical slots, when the caller has them already: a draft round maps every expansion step's slots in
    # one set of ops (batch_tree.draft_trees) instead of ~6 kernels in each step's forward
    phys: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict, repr=False)  # the reference's [B, T, S] masks, one per window
    _slot_map: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        self.n = self.n.reshape(-1)
        if self.new.dim() == 2:
            self.new = self.new[None]
        if self.block_table is None:
            assert self.n.numel() == 1, "a batch of requests needs a block table"
            self.block_table = torch.arange(-(-self.S // KV_BLOCK), device=self.new.device)[None]

    @property
    def B(self) -> int:
        return self.new.shape[0]

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        """The logical slots of the B * T rows -> their physical slots in the pool."""
        if self.phys is not None:
            return self.phys
        b = torch.arange(slots.numel(), device=slots.device) // self.new.shape[1]
        return self.block_table[b, slots // KV_BLOCK] * KV_BLOCK + slots % KV_BLOCK

    def slot_map(self) -> torch.Tensor:
        """[B, S]: the physical slot of every logical slot < S (reference path)."""
        if self._slot_map is None:
            cols = torch.arange(self.S, device=self.new.device)
            self._slot_map = self.block_table[:, cols // KV_BLOCK] * KV_BLOCK + cols % KV_BLOCK
        return self._slot_map

    def mask(self, window: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[B, T, S] bool (True = may attend), cut to `window` positions back when window > 0 (reference path).
        q_pos [B * T], k_pos the positions of the pool's physical slots."""
        if window not in self._masks:
            B, T, m = self.new.shape
            cols = torch.arange(self.S, device=self.new.device)
            j = cols - self.n[:, None]  # [B, S]: index among the new slots
            flag = self.new.gather(2, j.clamp(0, m - 1)[:, None, :].expand(B, T, self.S))
            mask = (j < 0)[:, None, :] | (flag & ((j >= 0) & (j < m))[:, None, :])
            if window:
                mask &= (q_pos.reshape(B, T, 1) - k_pos[self.slot_map()][:, None, :]) < window
            self._masks[window] = mask
        return self._masks[window]


@dataclass
class Spans:
    """Several Spans over consecutive rows of one pass: a step's prefill chunks (one Span each, no padding rows)
    and its decode rows (one Span of B requests x 1 row). The row-wise work (GEMMs, norms, rotary, cache writes)
    runs once over all rows. causal: the builder promises every part's mask is the causal triangle of its own rows
    (new [B, T, T] lower-triangular: a prompt chunk, or one-row decodes), as BatchRunner.pack builds them; then the
    fast path attends over all parts in one launch (triton_layers.attention_varlen), a step with many chunks
    being bound by the host's launches otherwise. Else, and on the reference path, attention runs once per part."""
    parts: list[Span]
    causal: bool = False
    # optional, from a builder whose parts' tables are rows of one table (BatchRunner.pack): that table and the row
    # of it each of the pass's rows reads, so `physical` is one gather for every part instead of ~6 ops a part
    table: torch.Tensor | None = None
    row_table: torch.Tensor | None = None  # [rows] long
    # attention_varlen's tile height, fixed by a caller whose pass a CUDA graph replays (else planned from the longest
    # part), and its tiles and metadata, per pass: such a caller puts its own (device buffers that the graph reads)
    block_m: int | None = None
    _varlen: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        # the shapes are what can be checked without reading the device; the triangle is the builder's word
        assert not self.causal or all(p.new.shape[1] == p.new.shape[2] for p in self.parts), "causal parts: T == m"

    @property
    def rows(self) -> list[int]:
        return [p.B * p.new.shape[1] for p in self.parts]

    def layout(self, G: int, block_m: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return varlen_layout([p.new.shape[:2] for p in self.parts], G, block_m)

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        if self.row_table is not None:
            return self.table[self.row_table, slots // KV_BLOCK] * KV_BLOCK + slots % KV_BLOCK
        return torch.cat([p.physical(s) for p, s in zip(self.parts, slots.split(self.rows))])


def varlen_layout(parts: list[tuple[int, int]], G: int, block_m: int):
    """attention_varlen's work list, on the host, for causal parts of (B requests, T rows each): each sequence (a
    chunk, or one decode row) as (first row in the pass, rows T), and the tiles (sequence, row block of block_m
    (token, head) rows of G heads a token), a sequence's last row blocks first (they read the most keys: the grid's
    last wave is short tiles)."""
    seqs, row = [], 0
    for B, T in parts:
        seqs += [(r, T) for r in range(row, row + B * T, T)]
        row += B * T
    tiles = [(s, blk) for s, (_, T) in enumerate(seqs) for blk in reversed(range(-(-T * G // block_m)))]
    return seqs, tiles


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm over the last dim, weighted by (offset + w). On CUDA add_rms_norm's kernel with no add: one launch
    where the reference is ~9 (on the H200 the EAGLE-3 draft's norms, 18 calls a round, made ~150 of its kernels)."""
    if fast(x, w):
        from .triton_layers import add_rms_norm as kernel
        return kernel(x.reshape(-1, x.shape[-1]).contiguous(), None, w, eps, offset)[1].view(x.shape)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + w.float())).to(x.dtype)


def norm_cat(a: torch.Tensor, b: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, eps: float,
             rows: torch.Tensor | None = None) -> torch.Tensor:
    """[rms_norm(a) by wa | rms_norm(b) by wb] over the last dim -> [..., 2 d]: an EAGLE-3 layer's input (the
    token's embedding and the feature, each normed, side by side). rows: a is an embedding table [V, d] and its
    rows[...] are the embeddings (gathered in the same launch). On CUDA one launch where the reference is three or
    four (the gather, two norms and the cat), in each of a round's six draft-layer calls."""
    d = b.shape[-1]
    if fast(a, b, wa, wb) and a.dtype == b.dtype and (a.shape == b.shape if rows is None else rows.shape == b.shape[:-1]):
        from .triton_layers import norm_cat as kernel
        return kernel(a.reshape(-1, d).contiguous(), b.reshape(-1, d).contiguous(), wa, wb, eps,
                      None if rows is None else rows.reshape(-1).contiguous()).view(*b.shape[:-1], 2 * d)
    if rows is not None:
        a = a[rows]
    return torch.cat([rms_norm(a, wa, eps, 0.0), rms_norm(b, wb, eps, 0.0)], -1)


def add_rms_norm(res: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float, offset: float,
                 delta_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """res + delta (delta first normed by delta_w: Gemma's post-norms), and the RMSNorm of that sum by w.
    Returns (new residual, normed). delta None: just the norm of res."""
    if fast(res, delta, w, delta_w):
        from .triton_layers import add_rms_norm as kernel  # the kernel reads rows densely
        return kernel(res.contiguous(), None if delta is None else delta.contiguous(), w, eps, offset, delta_w)
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
    cache pools [KV, slots, D] at the physical `slots`. qk_norm: Gemma's per-head (1 + w) RMSNorm of q and k,
    before the rotation."""
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


def move_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the cache pools' [layers, kv_heads, slots, D] physical slots src -> dst ([B, P] each, one request a row:
    a verified tree's accepted path moved to its committed slots; a row's sources and destinations may overlap,
    different rows' never do), in every layer and head. On CUDA one kernel: torch splits its indexing of a pool of more
    than 2^31 elements into launches of 32-bit-indexable pieces, the likely source of the 2 x 33 index kernels (~190
    us) a round that the H200 trace found outside the round's named pieces (not measured since)."""
    D = k_cache.shape[-1]
    if fast(k_cache, v_cache) and src.dim() == 2 and D & (D - 1) == 0:  # (the kernel's row is a power of 2)
        from .triton_layers import move_slots as kernel
        return kernel(k_cache, v_cache, src, dst)
    k_cache[:, :, dst] = k_cache[:, :, src]
    v_cache[:, :, dst] = v_cache[:, :, src]


def act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up [T, I]; SiLU (Llama, Qwen2) or tanh-GELU (Gemma)."""
    if fast(gate_up):
        from .triton_layers import act_mul as kernel
        return kernel(gate_up, gelu)
    g, u = gate_up.chunk(2, dim=-1)
    return (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: Span, q_pos: torch.Tensor,
              k_pos: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q [B * T, H, D] over the cache pools [KV, slots, D] (GQA: q head h reads kv head h // (H / KV)) as `span`
    says, keys at most window - 1 positions back when window > 0 -> [B * T, H, D]. k_pos: position of every
    physical slot. `span` may be Spans: each part attends on its own rows (a causal one in one launch on CUDA)."""
    if isinstance(span, Spans):
        if span.causal and fast(q, k_cache, v_cache):
            from .triton_layers import attention_varlen
            return attention_varlen(q, k_cache, v_cache, span, q_pos, k_pos, window, scale)
        rows = span.rows
        return torch.cat([attention(qp, k_cache, v_cache, part, pp, k_pos, window, scale)
                          for part, qp, pp in zip(span.parts, q.split(rows), q_pos.split(rows))])
    if fast(q, k_cache, v_cache) and (_FORCE or span.new.shape[1] < LONG_ROWS):  # checks force every span
        from .triton_layers import attention as kernel
        return kernel(q, k_cache, v_cache, span, q_pos, k_pos, window, scale,
                      attention_choice(q, k_cache, v_cache, span, q_pos, k_pos, window, scale))
    B, T = span.new.shape[:2]
    H, D = q.shape[1:]
    slots = span.slot_map()  # each request's own keys, gathered out of the pool: [KV, B, S, D] -> [B, KV, S, D]
    k, v = k_cache[:, slots].transpose(0, 1), v_cache[:, slots].transpose(0, 1)
    gqa = H != k.shape[1]
    if gqa and q.is_cuda:  # CUDA's SDPA takes GQA with a mask only on its math kernel, which materialises the
        # [B, H, T, S] scores in fp32 (a long prefill chunk's pass spent most of its time there): with the kv heads
        # repeated, the memory-efficient kernel takes the mask (the CPU's flash kernel takes GQA and a mask as is)
        k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // k.shape[1], 1)
        gqa = False
    o = F.scaled_dot_product_attention(q.view(B, T, H, D).transpose(1, 2), k, v,
                                       attn_mask=span.mask(window, q_pos, k_pos)[:, None], scale=scale,
                                       enable_gqa=gqa)
    return o.transpose(1, 2).reshape(B * T, H, D)


SKINNY_ROWS = 64  # rows up to which a projection may run the Triton skinny GEMM (decode, draft and verify steps)
MARGIN = 0.97  # the skinny GEMM replaces cuBLAS only when at least 3% faster (timing noise must not flip choices)
FUSE = os.environ.get("MICROSPEC_FUSE", "1") != "0"  # norm_linear may fold the add + RMSNorm into its GEMM
# (0: never, for A/B runs of the whole model; bench-kernels --layers switches it per measurement)
_LINEAR: dict[tuple, dict] = {}  # per process: (device, N, K, rows bucket, dtype, bias, act) -> the measurement
_DISK: dict[str, dict] | None = None  # the measurements of earlier processes (choices_path), read once


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """F.linear(x, w, bias). act ('silu' | 'gelu'): x is gate | up [.., 2K] and the input is act_mul(x), so the
    down projection takes the gated activation into its prologue. On CUDA outside autograd, up to SKINNY_ROWS
    rows run plugins/triton_layers.skinny_linear with the config measured fastest for this shape and rows
    bucket, when it beat cuBLAS (linear_choice); otherwise act_mul + F.linear, as before."""
    x2 = x.reshape(-1, x.shape[-1])
    if (0 < x2.shape[0] <= SKINNY_ROWS and fast(x2, w, bias) and w.is_contiguous() and x2.stride(-1) == 1
            and w.numel() < 2 ** 31):  # the kernel's offsets are 32-bit
        from . import triton_layers as tk

        if _FORCE:  # the checks: always the kernel (a split config where the shape has one)
            config = tk.skinny_configs(x2.shape[0], *w.shape, x.dtype == torch.float32)[-1]
        else:
            config = linear_choice(x2, w, bias, act)["config"]
        if config is not None:
            return tk.skinny_linear(x2, w, bias, act, config).view(*x.shape[:-1], w.shape[0])
    if act is not None:
        x = act_mul(x2, act == "gelu").view(*x.shape[:-1], -1)
    return F.linear(x, w, bias)


VOCAB_TOP_MAX_K = 16  # vocab_top's picks are unrolled in its two kernels: the LM head's K_pre / K_ver / k_tree


def vocab_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V] over a vocabulary (an LM head's rows) -> the k largest of each row (values, ids) [T, k],
    largest first: torch.topk (the reference). On CUDA the two-pass selection of triton_layers.vocab_top instead
    (each row's chunks of 4,096 ids keep their k best, then one program a row merges them): torch's radix top-k
    over 152k-wide rows took 281 ms of a batch-64 microspec pass on the H200 (every prompt row's top-K_pre, every
    round's over its trees' logits), where one read of 8,192 rows of logits takes ~0.6 ms; the grouped selection
    that replaced it read the logits once too but took ~10 launches. Equal values: the fast path takes the lower
    id first, torch.topk any of them."""
    if k <= 0 or k > min(VOCAB_TOP_MAX_K, logits.shape[-1]) or not fast(logits):
        return logits.topk(k, -1)
    from .triton_layers import vocab_top
    return vocab_top(logits, k)


def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, V] -> the id of each row's largest value [T], the first of equals: torch.argmax (the reference).
    On CUDA vocab_top's first id instead (the same id: it takes the lower of equal values first), which spreads each
    row's 4,096-id chunks over the GPU: on the H100 over 151,936 bf16 logits 8.4 us at 1 row (an AR step) where
    torch.argmax takes 12.7, 18.1 at a round's 60 rows where it takes 27.4. A NaN ranks as -inf here, where
    torch.argmax picks it."""
    if logits.dim() != 2 or not fast(logits):
        return logits.argmax(-1)
    from .triton_layers import vocab_top
    return vocab_top(logits, 1)[1][:, 0]


# The tree kernels' sizes, past which the reference runs: tree_grow ranks the k x k children in one power-of-2
# square tile (k = 10: 128 x 128); tree_select's one program a request holds its pool's ranks (a power-of-2 block
# over the P = k + depth k k nodes, counted 32 at a time) and an N x N ancestor tile (the default tree: P = 510, N = 60)
TREE_GROW_MAX = 256  # k * k
TREE_POOL_MAX = 1024  # P
TREE_NODES_MAX = 128  # N


def tree_grow(cur_score: torch.Tensor, logp: torch.Tensor, ids: torch.Tensor, h: torch.Tensor, anc: torch.Tensor,
              step_eye: torch.Tensor):
    """One draft expansion's bookkeeping (speculative/batch_tree.py): the path scores of its k x k children [B, k * k],
    and of them the top-k that the next step expands: their pool indices, tokens, scores, parents' draft hiddens
    and ancestor rows (their parent's, plus their own bit). On CUDA one launch (a program per request) where the
    reference is ~10 kernels, torch's top-k of the k x k scores alone several (5 x 7 us a round on the H200).
    Ties: torch.topk's order among equal scores is unspecified (on CUDA); the kernel ranks them by child index, the
    lower first. Either picks a valid tree (the target verifies whatever is drafted); without ties both agree."""
    B, k = ids.shape[:2]
    if fast(cur_score, logp, h) and k * k <= TREE_GROW_MAX:
        from .triton_layers import tree_grow as kernel
        return kernel(cur_score, logp, ids, h, anc, step_eye)
    score = (cur_score[:, :, None] + logp).flatten(1)
    best = score.topk(k, dim=1).indices
    parent_row = best // k
    feat = h.gather(1, parent_row[:, :, None].expand(B, k, h.shape[-1]))
    anc = anc.gather(1, parent_row[:, :, None].expand(B, k, anc.shape[2])) | step_eye
    return score, best, ids.flatten(1).gather(1, best), score.gather(1, best), feat, anc


@functools.cache
def _tree_constants(k: int, depth: int, N: int, dev: torch.device) -> dict:
    """tree_select's index tensors for one tree shape, made once (a CUDA graph replays them without a kernel each)."""
    pool = k + depth * k * k
    level = torch.cat([torch.zeros(k, device=dev)] + [torch.full((k * k,), i + 1.0, device=dev) for i in range(depth)])
    return dict(
        first_idx=torch.arange(k, device=dev)[None],
        # the pool offset of expansion i's k inputs (i >= 1; the i-th level's top-k), element by element
        offsets=torch.tensor([k + i * k * k for i in range(depth - 1) for _ in range(k)], device=dev)[None],
        # the first level's parent: the pool's sink index (tree index 0, the root)
        root_parent=torch.full((1, k), pool, dtype=torch.long, device=dev),
        penalty=1e-4 * level, tree_idx=torch.arange(1, N, device=dev)[None],
        zero=torch.zeros(1, 1, dtype=torch.long, device=dev), eye_n=torch.eye(N, dtype=torch.bool, device=dev))


def tree_select(root: torch.Tensor, tok: torch.Tensor, score: torch.Tensor, best: torch.Tensor | None, k: int,
                N: int):
    """A round's pool -> its tree (speculative/tree.py's Tree fields: tokens, parent, depth [B, N], anc [B, N, N]).
    The pool: every level's candidates' tokens and path scores [B, P], P = k + depth k k (the first level's k, then
    each expansion's k x k children, k per input); best [B, (depth - 1) k]: the inputs of every expansion after
    the first, as indices among the level before (tree_grow's; None at depth 1). Per request, the best N-1 pool
    nodes by path score, kept in pool order (so parents precede children); a child never scores above its
    parent, and the tiny depth penalty breaks exact ties (p = 1.0 in fp32) so the chosen set always holds each
    chosen node's parent. On CUDA one launch (a program per request) where the reference is ~30 kernels (the
    parent index, top-(N-1), sort, scatter, gathers, a depth + 1 step ancestor closure). Ties (keys the penalty
    cannot part: -inf scores of a small window's empty slots, or scores so large that fp32 drops it): torch.topk's
    order among them is unspecified on CUDA; the kernel ranks equal keys by pool index, the lower first, and a
    parent's key is never below its child's and its index lower, so there too every chosen node's parent is
    chosen. Without ties both pick the same tree."""
    B, P = tok.shape
    depth = (P - k) // (k * k)
    c = _tree_constants(k, depth, N, tok.device)
    if fast(tok, score) and P <= TREE_POOL_MAX and N <= TREE_NODES_MAX:
        from .triton_layers import tree_select as kernel
        return kernel(root, tok, score, best, c["penalty"], k, N)
    # each node's parent (pool index): expansion i's k inputs -- the first level, then each level's top-k -- are the
    # parents of its k x k children
    inputs = c["first_idx"].expand(B, k)
    if best is not None:
        inputs = torch.cat([inputs, best + c["offsets"]], 1)
    parent = torch.cat([c["root_parent"].expand(B, k), inputs[:, :, None].expand(B, inputs.shape[1], k).flatten(1)], 1)
    dev = tok.device
    chosen = (score - c["penalty"]).topk(N - 1, dim=1).indices.sort(dim=1).values
    tree_of = torch.zeros(B, P + 1, dtype=torch.long, device=dev)  # pool index -> tree index; P: the root's sink
    tree_of.scatter_(1, chosen, c["tree_idx"].expand(B, N - 1))
    par = torch.cat([c["zero"].expand(B, 1), tree_of.gather(1, parent.gather(1, chosen))], 1)
    eye = c["eye_n"]
    anc = eye.expand(B, N, N)
    for _ in range(depth + 1):
        anc = eye | anc.gather(1, par[:, :, None].expand(B, N, N))
    tokens = torch.cat([root[:, None], tok.gather(1, chosen)], 1)
    return tokens, par, anc.sum(2) - 1, anc


def window_fill(slot_of: torch.Tensor, id_of: torch.Tensor, fill_ids: torch.Tensor, batch: torch.Tensor,
                R: int) -> torch.Tensor:
    """A MicroSpec window's kept fill ids (vocab/batched.py BatchWindow, vocab/strategies.py Fill) for the windows
    of batch [B]: of the fill's ranked ids fill_ids [F], those not in the window (slot_of[slot, id] < 0), most
    frequent first, as many as the window leaves free of its R slots (R - its ids held, id_of[slot, :R] >= 0);
    -1 where not kept -> [B, F]. On CUDA one launch (a program per request) where the reference is ~13 kernels, at
    every round's window update."""
    if fast(slot_of, id_of, fill_ids, batch):
        from .triton_layers import window_fill as kernel
        return kernel(slot_of, id_of, fill_ids, batch, R)
    V1 = slot_of.shape[1]
    outside = slot_of.view(-1)[batch[:, None] * V1 + fill_ids] < 0
    free = R - (id_of[batch, :R] >= 0).sum(1)
    outside &= torch.cumsum(outside.long(), -1) <= free[:, None]
    return torch.where(outside, fill_ids, -1)


@functools.cache
def arange_once(n: int, dev: torch.device) -> torch.Tensor:
    """torch.arange(n) on dev, made once (a CUDA graph replays it without a kernel each)."""
    return torch.arange(n, device=dev)


def tree_accept(tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                choice: torch.Tensor, max_path: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Acceptance of B trees (tokens, parent, depth [B, N], anc [B, N, N]) against the target's choice after each
    node [B, N] (its argmax, or its draw): a node is right when its token is the choice after its parent (the
    root always), accepted when it and its ancestors are right. -> path [B, max_path] (tree indices by depth, the
    deepest accepted node -- the first of equals -- repeated past its depth), k [B] (its depth: draft tokens
    accepted), emitted [B, max_path] (the choice after each path node: valid up to index k). On CUDA one launch
    where this reference is ~20 kernels."""
    B, N = tokens.shape
    if fast(tokens, choice) and N <= TREE_NODES_MAX:
        from .triton_layers import tree_accept as kernel
        return kernel(tokens, parent, depth, anc, choice, max_path)
    levels = arange_once(max_path, tokens.device)
    ok = (tokens == choice.gather(1, parent)) | (depth == 0)
    path_ok = ~(anc & ~ok[:, None, :]).any(2)
    leaf = torch.where(path_ok, depth, -1).argmax(1)  # [B]
    leaf_anc = anc.gather(1, leaf[:, None, None].expand(B, 1, N))  # [B, 1, N]
    on_path = leaf_anc & (depth[:, None, :] == levels[None, :, None])  # [B, max_path, N]
    path = torch.where(on_path.any(2), on_path.float().argmax(2), leaf[:, None])
    return path, depth.gather(1, leaf[:, None])[:, 0], choice.gather(1, path)


def linear_choice(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, act: str | None) -> dict:
    """What `linear` runs for this call's shape: measured on the first eager call of each (shape, rows bucket)
    and kept, in this process and in the choices file (choices_path). {"config": None (cuBLAS) or a
    skinny_configs entry, "torch_us", "triton_us"}. Inside a CUDA-graph capture nothing can be timed: an
    unmeasured shape takes cuBLAS there (not kept)."""
    from . import triton_layers as tk

    def ref():
        return F.linear(act_mul(x, act == "gelu") if act else x, w, bias)

    return _choice(x, w, bias is not None, act, ref, lambda config: tk.skinny_linear(x, w, bias, act, config))


def norm_linear(res: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, offset: float,
                w: torch.Tensor, bias: torch.Tensor | None = None, delta_w: torch.Tensor | None = None,
                rope: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(res, delta, norm_w, eps, offset, delta_w), then linear(normed, w, bias) -> (new residual,
    out). rope: rope_cache_write's arguments after qkv (heads, kv_heads, rope, positions, slots, k_cache,
    v_cache, qk_norm, eps): w is q|k|v, its output goes through rope_cache_write, and out is the rotated q.
    On CUDA outside autograd, up to SKINNY_ROWS rows and without delta_w (Gemma's post-norms need the delta's
    own row norm first), the add and the norm ride in the skinny GEMM's prologue, and without Gemma's q/k norms
    the rotation and the KV-cache write in its epilogue (triton_layers.skinny_norm_linear: one launch instead
    of two to four), each where that measured faster than the path without it (norm_linear_choice)."""
    fuse = (FUSE and delta_w is None and 0 < res.shape[0] <= SKINNY_ROWS and fast(res, delta, norm_w, w, bias)
            and w.is_contiguous() and res.is_contiguous() and (delta is None or delta.is_contiguous())
            and w.numel() < 2 ** 31)
    if rope is not None:
        if fuse and rope[7] is None:
            config = norm_linear_choice(res, delta, norm_w, eps, offset, w, bias, rope)["config"]
            if config is not None:
                from .triton_layers import skinny_norm_linear
                return skinny_norm_linear(res, delta, norm_w, eps, offset, w, bias, config, rope[:7])
        res, qkv = norm_linear(res, delta, norm_w, eps, offset, w, bias, delta_w)
        return res, rope_cache_write(qkv, *rope)
    if fuse:
        config = norm_linear_choice(res, delta, norm_w, eps, offset, w, bias)["config"]
        if config is not None:
            from .triton_layers import skinny_norm_linear
            return skinny_norm_linear(res, delta, norm_w, eps, offset, w, bias, config)
    res, h = add_rms_norm(res, delta, norm_w, eps, offset, delta_w)
    return res, linear(h, w, bias)


def norm_linear_choice(res, delta, norm_w, eps, offset, w, bias, rope=None) -> dict:
    """What `norm_linear` runs for this shape: the fused kernel's fastest config, or None, measured against the
    path without the fold (add_rms_norm then linear; with rope: norm_linear's own choice then rope_cache_write)
    and kept as linear_choice's. Under the checks (layers.path(True)): the last candidate (split where the shape
    splits), no measurement."""
    from . import triton_layers as tk

    configs = tk.skinny_configs(res.shape[0], *w.shape, res.dtype == torch.float32)
    if rope is not None:
        configs = [c for c in configs if tk.rope_fits(c, rope[5].shape[-1])]
        if not configs:
            return {"config": None}
    if _FORCE:
        return {"config": configs[-1]}

    def ref():
        if rope is not None:
            return rope_cache_write(norm_linear(res, delta, norm_w, eps, offset, w, bias)[1], *rope)
        return linear(add_rms_norm(res, delta, norm_w, eps, offset)[1], w, bias)

    def kernel(config):
        return tk.skinny_norm_linear(res, delta, norm_w, eps, offset, w, bias, config, rope and rope[:7])[1]

    kind = ("norm+add" if delta is not None else "norm") + (f"+rope D={rope[5].shape[-1]}" if rope is not None else "")
    return _choice(res, w, bias is not None, kind, ref, kernel, configs if rope is not None else None)


def attention_choice(q, k_cache, v_cache, span: Span, q_pos, k_pos, window: int, scale: float) -> tuple | None:
    """The plan `attention` runs on CUDA: the fastest of attention_plan's and its candidates
    (triton_layers.attention_candidates: a split plan in one launch; wider key blocks, more warps or splits for a
    decode step of many requests), measured on the first eager call of each (heads, rows, requests, span bound)
    on this very input and kept as linear_choice's are (the choices file); a candidate runs only where >= 3%
    faster and agreeing with attention_plan's output. None (attention_plan's) where there is no candidate, under
    the checks, and inside a capture before a measurement. The span bound is keyed by its power-of-two bucket
    (span_bucket): a graph's S is a bucket already, but an eager step's S is the exact context, and keyed so every
    token's step measured anew (on the H100 trace at 1cd19b9: ~30 L2-flushing fills of ~32 us a round, and a
    512-token prefill 25.7 ms against 22.8 before). Every plan serves any S (check_layers runs plans with more
    splits than key blocks)."""
    from . import triton_layers as tk

    if _FORCE is not None:
        return None
    B, T = span.new.shape[:2]
    H, D = q.shape[1:]
    KV = k_cache.shape[0]
    key = (q.device, "attention", H, KV, D, T, B, span_bucket(span.S), q.dtype, window > 0)
    got = _LINEAR.get(key)  # every call of an eager step asks: the candidates are worked out once per key
    if got is not None:
        return got["config"]
    plans = tk.attention_candidates(T, H // KV, KV, span.S, D, B)
    if not plans:
        _LINEAR[key] = {"config": None}
        return None

    def run(plan=None):
        return tk.attention(q, k_cache, v_cache, span, q_pos, k_pos, window, scale, plan)

    return _kept(key, lambda: _measure(q, k_cache, run, run, plans, "attention plan"))["config"]


def span_bucket(S: int, smallest: int = 64) -> int:
    """The next power of two >= S, at least `smallest`: the span bound attention_choice keys on, and (capped at the
    cache length) the one a CUDA graph attends over (engine/graphs.bucket_for)."""
    return max(smallest, 1 << (S - 1).bit_length())


def _choice(x, w, has_bias: bool, kind: str | None, ref, kernel, configs=None) -> dict:
    M = x.shape[0]
    key = (x.device, *w.shape, 1 << (M - 1).bit_length(), x.dtype, has_bias, kind)
    return _kept(key, lambda: _measure(x, w, ref, kernel, configs))


def _kept(key: tuple, measure) -> dict:
    """The choice for key (its device first): this process's, else the choices file's, else measure() -- kept in
    both -- where it can run (CUDA, not capturing; else {"config": None}, not kept)."""
    got = _LINEAR.get(key)
    if got is None:
        disk = _disk_key(key)
        got = _choices().get(disk)
        if got is not None:
            got = _LINEAR[key] = {**got, "config": got["config"] and tuple(got["config"])}
            return got
        if key[0].type != "cuda" or torch.cuda.is_current_stream_capturing():
            return {"config": None}
        got = _LINEAR[key] = measure()
        if got.pop("measured", False):
            _remember(disk, got)
    return got


def choices_path() -> str | None:
    """Where linear_choice keeps its measurements across processes (a fresh process then compiles only the
    configs it runs and times nothing): MICROSPEC_LINEAR_CHOICES, else linear_choices.json in the model cache
    (MICROSPEC_CACHE, else ~/.cache/microspec). MICROSPEC_LINEAR_CHOICES=off: measure in every process. Delete
    the file to measure again; entries are keyed by GPU, torch, triton and the kernels' source, so a changed
    kernel or machine is measured afresh."""
    got = os.environ.get("MICROSPEC_LINEAR_CHOICES")
    if got == "off":
        return None
    cache = os.environ.get("MICROSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "microspec")
    return got or os.path.join(cache, "linear_choices.json")


def _disk_key(key: tuple) -> str:
    import hashlib

    import triton

    dev = key[0]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    src = open(os.path.join(os.path.dirname(__file__), "triton_layers.py"), "rb").read()
    version = (f"torch {torch.__version__} triton {triton.__version__} kernels {hashlib.sha1(src).hexdigest()[:12]} "
               f"margin {MARGIN}")
    return " | ".join([name, version, *map(str, key[1:])])


def _choices() -> dict[str, dict]:
    global _DISK
    if _DISK is None:
        import json

        path, _DISK = choices_path(), {}
        try:
            if path and os.path.exists(path):
                _DISK = json.loads(open(path).read())
        except (OSError, ValueError) as e:  # a damaged file: measure again (and overwrite it)
            warnings.warn(f"{path} unreadable, the projections are measured again: {e}")
    return _DISK


def _remember(disk_key: str, got: dict) -> None:
    """Add one measurement to the file (read again first: other processes may have added theirs; replaced
    whole, so a reader never sees half a file). Failing to write only costs the next process a measurement."""
    import json

    path = choices_path()
    _choices()[disk_key] = {**got, "config": got["config"] and list(got["config"])}
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            merged = {**json.loads(open(path).read()), **_DISK}
        except (OSError, ValueError):
            merged = dict(_DISK)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"linear choices not saved to {path}: {e}")


def _measure(x, w, ref, kernel, configs=None, what: str = "skinny GEMM") -> dict:
    """Time ref() (the path without the skinny GEMM; attention: attention_plan's) and kernel(config) for each
    config (default: the skinny configs of x's rows and w's shape) on this very input, L2 flushed before each
    replay (a decode step finds its weights cold); a config must also match ref's output. Any failure: ref."""
    from . import triton_layers as tk

    res = {"config": None, "torch_us": None, "triton_us": None}
    try:
        props = torch.cuda.get_device_properties(x.device)
        flush = torch.empty(2 * getattr(props, "L2_cache_size", 64 << 20), dtype=torch.uint8, device=x.device)
        want = ref().double()
        # entries the default leaves non-finite (a graph's padding rows may hold anything) are not compared
        finite = want.isfinite()
        want = torch.where(finite, want, 0.0)
        res["torch_us"] = _replay_us(ref, flush)
        tol = 1e-4 if x.dtype == torch.float32 else 1e-2
        for config in configs or tk.skinny_configs(x.shape[0], *w.shape, x.dtype == torch.float32,
                                                   props.multi_processor_count):
            def fn(config=config):
                return kernel(config)

            try:
                got = fn()
                err = float(torch.where(finite, got.double() - want, 0.0).norm() / want.norm().clamp_min(1e-30))
                if not err <= tol:  # NaN included
                    warnings.warn(f"{what} {config} differs from the default by {err:.1e} on {tuple(w.shape)}: skipped")
                    continue
                us = _replay_us(fn, flush)
            except Exception as e:  # a config the GPU cannot run (resources): the others still compete
                warnings.warn(f"{what} {config} on {tuple(w.shape)} failed: {e}")
                continue
            if res["triton_us"] is None or us < res["triton_us"]:
                res["triton_us"], best = us, config
        if res["triton_us"] is not None and res["triton_us"] < MARGIN * res["torch_us"]:
            res["config"] = best
        res["measured"] = True  # worth keeping for later processes
    except Exception as e:  # measuring must never break a run: the default is correct
        warnings.warn(f"{what} not measured for {tuple(w.shape)}, using the default: {e}")
        res["config"] = None
    return res


def _replay_us(fn, flush: torch.Tensor, iters: int = 15) -> float:
    """Median microseconds of one CUDA-graph replay of fn, L2 flushed before each (as kernels run in a step)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in events:
        flush.zero_()
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events[2:])
