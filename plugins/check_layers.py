"""`python -m plugins.check_layers`: the Triton layer kernels against the torch reference on random inputs.

Each op (add + RMSNorm, rotary + cache write, gated activation, the vocabulary top-k, the KV
slots' move, the projections' skinny GEMM in every config it may be measured in (with bias, with SiLU / GELU x up in
its prologue, split K, rows 1 .. 64, bf16 and fp32 even under the interpreter), attention over random tree / causal
/ windowed spans, over batches of requests with their own committed lengths in a pool behind random block tables,
and over a batched engine step's packed rows: prompt chunks and decode rows, `Spans`, in one launch and part by
part) and then whole forwards (one request, a batch in a paged pool against each request alone, packed passes of
chunks and decode rows) of small random Llama, Qwen2 (q/k/v bias) and Gemma-3 (sliding window, q/k norms, (1 + w)
norms, GELU) models. Inputs are fresh random draws; outputs are poisoned first (caches too) so an unwritten element
fails. Error = |got - ref| / |ref| (Frobenius), against a float64 reference for attention; bf16 must stay under
2e-2, fp32 under 1e-4. On a CPU run it with TRITON_INTERPRET=1 (the test suite does, on small shapes); on a GPU it
also checks the shapes of qwen2.5-coder-1.5b. Each check prints one line as it finishes (all configs of one
projection shape on one line), with its seconds; `--only TEXT` runs a subset; on a GPU the skinny GEMM's variants
are compiled in --jobs processes first.
Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from . import layers
from .layers import Span

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def random_tree(g, N: int, reach: int = 0) -> torch.Tensor:
    """[N, N] ancestor mask of a random tree whose parents precede their children (node 0 the root); reach > 0:
    a parent is one of the `reach` nodes before its child, so the depth grows like a drafted tree's."""
    anc = torch.eye(N, dtype=torch.bool)
    for i in range(1, N):
        anc[i] |= anc[int(torch.randint(max(0, i - reach) if reach else 0, i, (1,), generator=g))]
    return anc


def both(fn):
    """fn() on the Triton path and on the reference path."""
    with layers.path(True):
        fast = fn()
    with layers.path(False):
        ref = fn()
    return fast, ref


def check_norm(dev, dtype, g, d: int) -> float:
    err = 0.0
    for has_delta, norm_delta, offset in [(False, False, 0.0), (True, False, 0.0), (True, True, 1.0)]:
        res = torch.randn(7, d, generator=g).to(dev, dtype) * 3
        delta = torch.randn(7, d, generator=g).to(dev, dtype) if has_delta else None
        w, dw = (torch.randn(d, generator=g).to(dev, dtype) for _ in range(2))
        (r1, h1), (r2, h2) = both(lambda: layers.add_rms_norm(res, delta, w, 1e-6, offset,
                                                              dw if norm_delta else None))
        err = max(err, rel(r1, r2), rel(h1, h2))
    # strided rows (a column slice, as EAGLE-3's fc output or a tapped layer can be): read densely, same result
    wide = torch.randn(7, 2 * d, generator=g).to(dev, dtype)
    res, delta = wide[:, :d], wide[:, d:]
    (r1, h1), (r2, h2) = both(lambda: layers.add_rms_norm(res, delta, w, 1e-6, 0.0))
    err = max(err, rel(r1, r2), rel(h1, h2))
    # the plain norm (the draft's hidden / input / head norms) over [B, k, d] rows and a strided slice of them
    rows = torch.randn(3, 5, 2 * d, generator=g).to(dev, dtype) * 3
    for x, offset in ((rows[..., :d].contiguous(), 0.0), (rows[..., d:], 1.0)):
        err = max(err, rel(*both(lambda: layers.rms_norm(x, w, 1e-6, offset))))
    # EAGLE-3's layer input: the embedding and the feature normed side by side ([B, k, d] rows, one strided)
    err = max(err, rel(*both(lambda: layers.norm_cat(rows[..., :d], rows[..., d:], w, dw, 1e-6))))
    # ... the embeddings gathered from a table by token ids in the same launch
    table, ids = torch.randn(50, d, generator=g).to(dev, dtype), torch.randint(0, 50, (3, 5), generator=g).to(dev)
    err = max(err, rel(*both(lambda: layers.norm_cat(table, rows[..., d:], w, dw, 1e-6, ids))))
    return err


def check_act(dev, dtype, g, inter: int) -> float:
    gu = torch.randn(5, 2 * inter, generator=g).to(dev, dtype) * 2
    return max(rel(*both(lambda: layers.act_mul(gu, gelu))) for gelu in (False, True))


def check_topk(dev, dtype, g, T: int, V: int, k: int) -> float:
    """vocab_topk's fast path against torch.topk, and vocab_argmax's against torch.argmax: the same values, ids
    that hold them, and among equal values the lower id first (so the first id is torch.argmax's). Rows with ties
    at the top across chunks, a row whose top k are its last ids (the last, shorter chunk), a row where every id
    ties, a NaN (ranked as -inf). Error 0 or 1."""
    x = torch.randn(T, V, generator=g).to(dev, dtype)
    x[0, [V - 1, V // 2, 3]] = 9.0  # a tie at the top: the first chunk, a middle one, the last one
    x[-1, V - k:] = 8.0
    if T > 1:
        x[1] = 0.0  # every id ties
    if T > 2:
        x[2, 5] = float("nan")
    with layers.path(True):
        v1, i1 = layers.vocab_topk(x, k)
        top1 = layers.vocab_argmax(x)
    x = x.nan_to_num(float("-inf"))  # (torch.topk ranks NaN first)
    v2 = x.topk(k, -1).values
    same = torch.equal(v1, v2) and torch.equal(x.gather(1, i1), v1) and bool(((0 <= i1) & (i1 < V)).all())
    tie_order = bool(((v1[:, 1:] < v1[:, :-1]) | (i1[:, 1:] > i1[:, :-1])).all())
    argmax = x.argmax(-1)
    return 0.0 if same and tie_order and torch.equal(i1[:, 0], argmax) and torch.equal(top1, argmax) else 1.0


def check_move(dev, dtype, g, L: int, KV: int, D: int, P: int) -> float:
    """move_slots: three requests' accepted paths moved to their committed slots in every layer and head. Each row's
    sources are a path of tree nodes (increasing, the leaf repeated) and its destinations the next P slots, so a
    row's sources and destinations overlap; the rows are disjoint. Error 0 or 1 (a copy is exact)."""
    S = 4 * 64
    k, v = (torch.randn(L, KV, S, D, generator=g).to(dev, dtype) for _ in range(2))
    n = torch.tensor([0, 64, 128])  # each request's committed length; its tree's slots n .. n + 59
    src, dst = [], []
    for b in range(3):
        path = torch.randperm(12, generator=g)[:P].sort().values + torch.arange(P)  # a node of depth j: index >= j
        path[P // 2 + 1:] = path[P // 2]  # accepted up to half the path: the leaf repeated
        src.append(n[b] + path)
        dst.append(n[b] + torch.arange(P))
    both_ids = torch.cat([torch.stack(src), torch.stack(dst)], 1).to(dev)  # one [B, 2P] index, as the round's
    src, dst = both_ids[:, :P], both_ids[:, P:]

    def moved():
        kk, vv = k.clone(), v.clone()
        layers.move_slots(kk, vv, src, dst)
        return kk, vv

    (k1, v1), (k2, v2) = both(moved)
    return 0.0 if torch.equal(k1, k2) and torch.equal(v1, v2) and not torch.equal(k1, k) else 1.0


def check_tree_grow(dev, dtype, g, B: int, k: int, depth: int, d: int) -> float:
    """tree_grow at every expansion step of a round: random path scores (continuous: no ties), tokens, draft hiddens
    of `dtype` and ancestor rows. Error 0 or 1 (every output exactly the reference's)."""
    S = depth * k
    for i in range(depth - 1):
        eye = torch.zeros(k, S, dtype=torch.bool)
        eye[:, (i + 1) * k:(i + 2) * k] = torch.eye(k, dtype=torch.bool)
        cur = -torch.rand(B, k, generator=g) * (i + 1) * 3
        logp = -torch.rand(B, k, k, generator=g) * 6
        ids = torch.randint(0, 50000, (B, k, k), generator=g)
        h = torch.randn(B, k, d, generator=g).to(dtype)
        anc = torch.rand(B, k, S, generator=g) < 0.3
        args = [x.to(dev) for x in (cur, logp, ids, h, anc, eye)]
        fast, ref = both(lambda: layers.tree_grow(*args))
        if not all(torch.equal(a, b) for a, b in zip(fast, ref)):
            return 1.0
        # NaN log-probabilities (a padding row's garbage): the kernel ranks them as -inf, so a few NaN children
        # leave the top-k of the rest (the reference's over the same scores with -inf there), and a request of
        # NaN only expands children 0 .. k-1 (ties by index): never an index past its k x k children
        nan = torch.rand(B, k, k, generator=g) < 0.1
        nan[-1] = True
        args[1] = logp.masked_fill(nan, float("nan")).to(dev)
        with layers.path(True):
            fast = layers.tree_grow(*args)
        args[1] = logp.masked_fill(nan, float("-inf")).to(dev)
        with layers.path(False):
            ref = layers.tree_grow(*args)
        minus_inf = [x.nan_to_num(nan=float("-inf")) if x.is_floating_point() else x for x in fast]
        if not all(torch.equal(a[:-1], b[:-1]) for a, b in zip(minus_inf, ref)) \
                or not torch.equal(fast[1][-1].cpu(), torch.arange(k)):
            return 1.0
    return 0.0


def tree_pool(g, B: int, k: int, depth: int, logp_of) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's pool scores [B, P] and expansion inputs (best) as draft_trees grows them (the reference's
    tree_grow), each level's log-probabilities drawn by logp_of(shape)."""
    S = depth * k
    cur = logp_of((B, k))
    scores, bests = [cur], []
    anc, h = torch.zeros(B, k, S, dtype=torch.bool), torch.zeros(B, k, 1)
    with layers.path(False):
        for i in range(depth):
            logp = logp_of((B, k, k))
            if i + 1 == depth:
                scores.append((cur[:, :, None] + logp).flatten(1))
                break
            ids = torch.zeros(B, k, k, dtype=torch.long)
            score, best, _, cur, _, _ = layers.tree_grow(cur, logp, ids, h, anc, torch.zeros(k, S, dtype=torch.bool))
            scores.append(score)
            bests.append(best)
    return torch.cat(scores, 1), torch.cat(bests, 1) if bests else None


def check_window_fill(dev, g, B: int, V: int, R: int, F: int) -> float:
    """window_fill on random windows (each slot holding a random share of the vocabulary; one empty, one full)
    and a random ranking, the batch's last two rows one padding slot repeated: exactly the reference's kept ids.
    Error 0 or 1."""
    slots = B + 3
    held = torch.rand(slots, V + 1, generator=g) < torch.rand(slots, 1, generator=g) * 0.5
    held[0] = False  # an empty window: the fill's first R ids are kept
    slot_of = torch.where(held, torch.randint(0, R, (slots, V + 1), generator=g), -1)
    id_of = torch.where(torch.rand(slots, R + 1, generator=g) < torch.rand(slots, 1, generator=g), 1, -1)
    id_of[1, :R] = 1  # a full window: no fill id kept
    fill_ids = torch.randperm(V, generator=g)[:F]
    batch = torch.cat([torch.tensor([0, 1]), torch.randperm(slots - 3, generator=g)[:max(B - 2, 0)] + 2,
                       torch.full((2,), slots - 1)])
    args = [x.to(dev) for x in (slot_of, id_of, fill_ids, batch)]
    fast, ref = both(lambda: layers.window_fill(*args, R))
    return 0.0 if torch.equal(fast.cpu(), ref.cpu()) else 1.0


def check_tree_select(dev, g, B: int, k: int, depth: int, N: int) -> float:
    """tree_select on a round's pool grown from random log-probabilities (continuous: no ties): exactly the
    reference's tree. Then a pool full of ties (log-probabilities 0, -0.5, -1 and -inf: p = 1.0 children, and
    -inf children tying their -inf parents, whom the depth penalty cannot set apart), where the kernel's tie order
    may differ from torch.topk's: still a tree of the best N-1 keys whose every chosen node's parent is chosen
    (parents precede children, ancestor rows and depths follow their parent's). Error 0 or 1."""
    P = k + depth * k * k
    root = torch.randint(0, 50000, (B,), generator=g).to(dev)
    score, best = tree_pool(g, B, k, depth, lambda shape: -torch.rand(*shape, generator=g) * 6)
    tok = torch.randint(0, 50000, (B, P), generator=g)
    args = [x if x is None else x.to(dev) for x in (root, tok, score, best)]
    fast, ref = both(lambda: layers.tree_select(*args, k, N))
    if not all(torch.equal(a, b) for a, b in zip(fast, ref)):
        return 1.0

    def tied(shape):  # a head's top-k: its first id 0, -0.5 or -1, most others -inf (empty slots of a small window)
        x = -0.5 * torch.randint(0, 3, shape, generator=g).float()
        x[..., 1:] = x[..., 1:].masked_fill(torch.rand(*shape[:-1], shape[-1] - 1, generator=g) < 0.9, float("-inf"))
        return x

    # a request whose pool is all NaN (a padding row's garbage) beside a real one: the real request's tree is the
    # reference's; the NaN one's (NaN ranks as -inf, ties by pool index) is the pool's first N-1 nodes, its
    # expansions' inputs those of tree_grow on NaN (children 0 .. k-1), so node x's parent is the root (x < k) or
    # first-level node (x - k) // k: never a node past the pool
    nan_score, nan_best = score.clone(), None if best is None else best.clone()
    nan_score[-1] = float("nan")
    if nan_best is not None:
        nan_best[-1] = torch.arange(k).repeat(depth - 1)
    nan_args = [x if x is None else x.to(dev) for x in (root, torch.arange(P).expand(B, P), nan_score, nan_best)]
    with layers.path(True):
        fast = [x.cpu() for x in layers.tree_select(*nan_args, k, N)]
    with layers.path(False):
        real = [x.cpu() for x in layers.tree_select(*[x if x is None else x[:-1] for x in nan_args], k, N)]
    if B > 1 and not all(torch.equal(a[:-1], b) for a, b in zip(fast, real)):
        return 1.0
    x = torch.arange(N - 1)
    if N - 1 <= k + k * k and not (torch.equal(fast[0][-1, 1:], x)
                                   and torch.equal(fast[1][-1, 1:], torch.where(x < k, 0, (x - k) // k + 1))
                                   and torch.equal(fast[2][-1, 1:], torch.where(x < k, 1, 2))):
        return 1.0

    score, best = tree_pool(g, B, k, depth, tied)
    tok = torch.arange(P).expand(B, P)  # a node's token: its pool index
    args = [x if x is None else x.to(dev) for x in (root, tok, score, best)]
    fast, ref = both(lambda: layers.tree_select(*args, k, N))
    penalty = layers._tree_constants(k, depth, N, dev)["penalty"]
    key = (args[2] - penalty).cpu()
    with layers.path(False):  # the whole pool as a tree (N = P + 1): tree index = pool index + 1, so its parents
        pool_parent = layers.tree_select(*args, k, P + 1)[1].cpu()[:, 1:] - 1  # are the pool's (-1: the root)
    (tokens, parent, deep, anc), (ref_tokens, *_) = [[x.cpu() for x in t] for t in (fast, ref)]
    for b in range(B):
        if not torch.equal(key[b, tokens[b, 1:]].sort().values, key[b, ref_tokens[b, 1:]].sort().values):
            return 1.0  # not the best N-1 keys
        if parent[b, 0] != 0 or deep[b, 0] != 0 or not torch.equal(anc[b, 0], torch.eye(N, dtype=torch.bool)[0]):
            return 1.0
        for n in range(1, N):
            p = int(parent[b, n])
            if (tokens[b, p] if p else -1) != pool_parent[b, tokens[b, n]]:
                return 1.0  # the node's own parent not chosen (or another node's taken for it)
            want = anc[b, p].clone()
            want[n] = True
            if not (p < n and deep[b, n] == deep[b, p] + 1 and torch.equal(anc[b, n], want)):
                return 1.0
    return 0.0


def check_tree_accept(dev, g, B: int, k: int, depth: int, N: int) -> float:
    """tree_accept on trees tree_select made from random pools, against choices that make a random node's whole
    path right (and, in some requests, a sibling of equal token and depth: the first of equals is the leaf), others
    random; where there are two or more requests the last is all wrong (only the root accepted). Exactly the
    reference's path, k and emitted. Error 0 or 1."""
    P = k + depth * k * k
    score, best = tree_pool(g, B, k, depth, lambda shape: -torch.rand(*shape, generator=g) * 6)
    tok = torch.randint(0, 8, (B, P), generator=g)  # few distinct ids: siblings often share one
    root = torch.randint(0, 8, (B,), generator=g)
    with layers.path(False):
        tokens, parent, deep, anc = layers.tree_select(root, tok, score, best, k, N)
    choice = torch.randint(0, 8, (B, N), generator=g)
    wrong = B > 1  # the last request all wrong
    for b in range(B - wrong):
        n = int(torch.randint(1, N, (1,), generator=g))
        while n:  # every node on n's path right: the choice after its parent is its token
            choice[b, parent[b, n]] = tokens[b, n]
            n = int(parent[b, n])
    if wrong:
        choice[-1] = -1
    args = [x.to(dev) for x in (tokens, parent, deep, anc, choice)]
    fast, ref = both(lambda: layers.tree_accept(*args, depth + 2))
    return 0.0 if all(torch.equal(a.cpu(), r.cpu()) for a, r in zip(fast, ref)) and int(ref[1][0]) > 0 \
        and (not wrong or int(ref[1][-1]) == 0) else 1.0


def check_linear(dev, dtype, g, M: int, N: int, K: int, bias: bool, act: str | None) -> list[tuple[tuple, float]]:
    """Every skinny_configs candidate of this shape against the reference (act_mul, then F.linear)."""
    from .triton_layers import skinny_configs, skinny_linear

    gd = torch.Generator(device=dev).manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))  # the LM head:
    x = torch.randn(M, 2 * K if act else K, generator=gd, device=dev).to(dtype)  # 233M draws, on the device
    w = (torch.randn(N, K, generator=gd, device=dev) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=gd, device=dev).to(dtype) if bias else None
    with layers.path(False):
        ref = layers.linear(x, w, b, act)
    return [(c, again(lambda: skinny_linear(x, w, b, act, c), ref))
            for c in skinny_configs(M, N, K, dtype == torch.float32)]


def again(fn, ref: torch.Tensor) -> float:
    """rel(fn(), ref), and fn() a second time must give the same bits (a split launch leaves its counters at 0
    and sums in a fixed order): inf if not."""
    first = fn()
    return rel(first, ref) if torch.equal(fn(), first) else float("inf")


def check_norm_linear(dev, dtype, g, M: int, N: int, K: int, bias: bool, has_delta: bool,
                      offset: float) -> list[tuple[tuple, float]]:
    """The residual add + RMSNorm folded into the skinny GEMM (every config) against add_rms_norm + F.linear:
    the larger error of the new residual and the output."""
    from .triton_layers import skinny_configs, skinny_norm_linear

    gd = torch.Generator(device=dev).manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    res = (torch.randn(M, K, generator=gd, device=dev) * 3).to(dtype)
    delta = torch.randn(M, K, generator=gd, device=dev).to(dtype) if has_delta else None
    nw = torch.randn(K, generator=gd, device=dev).to(dtype)
    w = (torch.randn(N, K, generator=gd, device=dev) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=gd, device=dev).to(dtype) if bias else None
    with layers.path(False):
        ref_res, ref = layers.norm_linear(res, delta, nw, 1e-6, offset, w, b)
    out = []
    for c in skinny_configs(M, N, K, dtype == torch.float32):
        got_res, _ = skinny_norm_linear(res, delta, nw, 1e-6, offset, w, b, c)
        err = again(lambda: skinny_norm_linear(res, delta, nw, 1e-6, offset, w, b, c)[1], ref)
        out.append((c, max(err, rel(got_res, ref_res))))
    return out


def check_norm_qkv_rope(dev, dtype, g, M: int, H: int, KV: int, D: int, K: int, bias: bool,
                        has_delta: bool) -> list[tuple[tuple, float]]:
    """add + RMSNorm + q|k|v + rotary + KV-cache write in one launch (every config whose column blocks tile the
    heads) against norm_linear + rope_cache_write on the reference path: the largest error of the new residual,
    q, and the k and v written (the caches poisoned first, so an unwritten slot fails)."""
    from .triton_layers import rope_fits, skinny_configs, skinny_norm_linear

    gd = torch.Generator(device=dev).manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    N, S = (H + 2 * KV) * D, 3 * M + 8
    res = (torch.randn(M, K, generator=gd, device=dev) * 3).to(dtype)
    delta = torch.randn(M, K, generator=gd, device=dev).to(dtype) if has_delta else None
    nw = torch.randn(K, generator=gd, device=dev).to(dtype)
    w = (torch.randn(N, K, generator=gd, device=dev) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=gd, device=dev).to(dtype) if bias else None
    ang = torch.rand(S, D // 2, generator=gd, device=dev) * 6
    cos, sin = ang.cos(), ang.sin()
    pos = torch.randint(S, (M,), generator=gd, device=dev)
    slots = torch.randperm(S, generator=gd, device=dev)[:M]

    def run(fn):
        k = torch.full((KV, S, D), float("nan"), dtype=dtype, device=dev)
        v = k.clone()
        new_res, q = fn((H, KV, (cos, sin), pos, slots, k, v))
        return new_res, q, k[:, slots], v[:, slots]

    with layers.path(False):
        ref = run(lambda r: layers.norm_linear(res, delta, nw, 1e-6, 0.0, w, b, rope=(*r, None, 1e-6)))
    out = []
    for c in [c for c in skinny_configs(M, N, K, dtype == torch.float32) if rope_fits(c, D)]:
        got = run(lambda r: skinny_norm_linear(res, delta, nw, 1e-6, 0.0, w, b, c, r))
        again = run(lambda r: skinny_norm_linear(res, delta, nw, 1e-6, 0.0, w, b, c, r))
        same = all(torch.equal(a, b) for a, b in zip(got, again))  # counters reset, fixed sum order: same bits
        out.append((c, max(rel(a, r) for a, r in zip(got, ref)) if same else float("inf")))
    return out


def build_skinny_for_hopper(M: int, config: tuple[int, int, int], fp32: bool, act: bool, bias: bool,
                            norm: bool = False, rope: bool = False):
    """Compile the skinny GEMM for sm_90 without a GPU (Triton's own ptxas), with the 16-divisibility Triton
    infers for real shapes: -> (shared memory bytes, whether the K loop is pipelined through cp.async)."""
    from triton import compile as build
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .triton_layers import _skinny_kernel

    dt = "fp32" if fp32 else "bf16"
    block_n, block_k, splits = config
    const = dict(HAS_BIAS=bias, ACT=act, GELU=act, SPLIT=splits > 1, NORM=norm, HAS_DELTA=norm, ROPE=rope,
                 HEAD_D=128, BLOCK_M=16 if M <= 16 else 32 if M <= 32 else 64, BLOCK_N=block_n, BLOCK_K=block_k,
                 IEEE=fp32)
    sig = {**{p: f"*{dt}" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")}, "part_ptr": "*fp32",
           **{p: f"*{dt}" for p in ("d_ptr", "nw_ptr", "res_ptr")}, "sq_ptr": "*fp32", "cnt_ptr": "*i32",
           "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64",
           **{p: f"*{dt}" for p in ("q_ptr", "k_ptr", "v_ptr")},
           **{n: "i32" for n in ("M", "N", "K", "k_split", "n_splits", "stride_xm")}, "eps": "fp32", "offset": "fp32",
           **{n: "i32" for n in ("H", "KV", "stride_pos", "stride_slot", "stride_kh", "stride_ks")},
           **{k: "constexpr" for k in const}}
    names = _skinny_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig
             if n not in const and n not in ("M", "n_splits", "eps", "offset", "H", "KV", "stride_pos", "stride_slot")}
    k = build(ASTSource(_skinny_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
              options=dict(num_warps=4, num_stages=3 if fp32 or M > 16 else 4))
    return k.metadata.shared, "cp.async" in k.asm["ptx"]


def check_rope(dev, dtype, g, H: int, KV: int, D: int, qk_norm: bool) -> float:
    T, S = 9, 64
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dev, dtype)
    ang = torch.rand(S, D // 2, generator=g).to(dev) * 6
    rope = (ang.cos(), ang.sin())
    # one position for every row, expanded (stride 0), as the draft's expansion steps pass it
    pos = torch.randint(S, (1,), generator=g).to(dev).expand(T) if qk_norm else torch.randint(S, (T,), generator=g).to(dev)
    slots = torch.randperm(S, generator=g)[:T].to(dev)
    norms = tuple(torch.randn(D, generator=g).to(dev, dtype) for _ in range(2)) if qk_norm else None
    outs = []
    for use in (True, False):
        k = torch.full((KV, S, D), float("nan"), dtype=dtype, device=dev)
        v = k.clone()
        with layers.path(use):
            q = layers.rope_cache_write(qkv, H, KV, rope, pos, slots, k, v, norms, 1e-6)
        outs.append((q, k[:, slots], v[:, slots]))
    return max(rel(a, b) for a, b in zip(*outs))


def check_attention(dev, dtype, g, H: int, KV: int, D: int, T: int, n: int, S: int, window: int,
                    kind: str, kernel: bool = True, plan=None) -> float:
    """kind: 'tree' (T new slots, a random ancestor mask), 'causal', or 'draft' (T rows, the last T of 3T new
    slots, each row seeing a random subset of the earlier new slots and itself). kernel False: the reference path
    on this device (what a long prefill chunk runs: SDPA, its kv heads repeated on CUDA). plan: the kernel's
    (BLOCK_M, BLOCK_N, n_splits, num_warps) instead of attention_plan's (bench-kernels --attention's sweep)."""
    m = 3 * T if kind == "draft" else T
    if kind == "tree":
        new = random_tree(g, T)
    elif kind == "causal":
        new = torch.ones(T, T, dtype=torch.bool).tril()
    else:  # a column slice of a wider mask, as the draft expansion passes it (rows not contiguous)
        new = torch.rand(T, m + 5, generator=g) < 0.3
        new[:, m - T:m] = torch.eye(T, dtype=torch.bool)
        new = new[:, :m]
    q = torch.randn(T, H, D, generator=g).to(dev, dtype)
    Smax = S + 16
    k = torch.randn(KV, Smax, D, generator=g).to(dev, dtype)
    v = torch.randn(KV, Smax, D, generator=g).to(dev, dtype)
    k_pos = torch.randperm(Smax, generator=g).to(dev)  # slots need not hold increasing positions
    q_pos = torch.randint(Smax, (T,), generator=g).to(dev)
    if kind == "draft":  # one position expanded over the rows (stride 0), as draft_tree passes it
        q_pos = q_pos[:1].expand(T)
    span = Span(torch.tensor(n, device=dev), new.to(dev), S)
    scale = D ** -0.5
    if plan is not None:
        from .triton_layers import attention as kernel_attention
        got = kernel_attention(q, k, v, span, q_pos, k_pos, window, scale, plan)
    else:
        with layers.path(kernel):
            got = layers.attention(q, k, v, span, q_pos, k_pos, window, scale)
    mask = span.mask(window, q_pos, k_pos)[0]
    # a row that sees nothing (possible only with a window in this synthetic test) is left out
    seen = mask.any(1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k[:, :S].double(), v[:, :S].double(), attn_mask=mask, scale=scale,
        enable_gqa=True).transpose(0, 1)
    return rel(got[seen], ref[seen])


def check_paged_attention(dev, dtype, g, H: int, KV: int, D: int, B: int, T: int, S: int, window: int,
                          kind: str, plan=None) -> float:
    """B requests of T rows each, every one with its own committed length n (0 .. S - T) and new-slot mask, its
    slots scattered over a shared pool by a random block table. Both paths (Triton and the batched reference)
    against a float64 attention of each request alone over its own contiguous keys. plan: the kernel alone with
    this plan (a decode plan layers.attention_choice may pick) instead of both paths."""
    from .layers import KV_BLOCK

    blocks = -(-S // KV_BLOCK)
    pool = B * blocks + 3  # spare blocks: not every pool block belongs to a request
    table = torch.randperm(pool, generator=g)[:B * blocks].view(B, blocks)
    n = torch.randint(0, S - T + 1, (B,), generator=g)
    n[0] = S - T  # one request fills the span
    if kind == "tree":
        new = torch.stack([random_tree(g, T) for _ in range(B)])
    else:
        new = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    q = torch.randn(B * T, H, D, generator=g).to(dev, dtype)
    k_log = torch.randn(B, KV, S, D, generator=g).to(dtype)  # each request's keys by logical slot
    v_log = torch.randn(B, KV, S, D, generator=g).to(dtype)
    pos_log = torch.stack([torch.randperm(S, generator=g) for _ in range(B)])
    phys = (table[:, torch.arange(S) // KV_BLOCK] * KV_BLOCK + torch.arange(S) % KV_BLOCK)  # [B, S]
    k = torch.full((KV, pool * KV_BLOCK, D), float("nan"), dtype=dtype)  # slots no request owns are poison
    v = k.clone()
    k_pos = torch.zeros(pool * KV_BLOCK, dtype=torch.long)
    for b in range(B):
        k[:, phys[b]], v[:, phys[b]], k_pos[phys[b]] = k_log[b], v_log[b], pos_log[b]
    k, v, k_pos = k.to(dev), v.to(dev), k_pos.to(dev)
    # each row at the position of its own new slot, so windows cut inside the committed keys
    q_pos = torch.cat([pos_log[b, n[b] + torch.arange(T)] for b in range(B)]).to(dev)
    span = Span(n.to(dev), new.to(dev), S, table.to(dev))
    if plan is not None:
        from .triton_layers import attention as kernel_attention
        got = ref_b = kernel_attention(q, k, v, span, q_pos, k_pos, window, D ** -0.5, plan)
    else:
        got, ref_b = both(lambda: layers.attention(q, k, v, span, q_pos, k_pos, window, D ** -0.5))
    err = 0.0
    for b in range(B):
        rows = slice(b * T, (b + 1) * T)
        one = Span(n[b], new[b], S)
        mask = one.mask(window, q_pos[rows].cpu(), pos_log[b])[0]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[rows].cpu().double().transpose(0, 1), k_log[b].double(), v_log[b].double(), attn_mask=mask,
            scale=D ** -0.5, enable_gqa=True).transpose(0, 1)
        seen = mask.any(1)
        err = max(err, rel(got[rows].cpu()[seen], ref[seen]), rel(ref_b[rows].cpu()[seen], ref[seen]))
    return err


def tiny_config(arch: str, D: int):
    from trtllm_microspec.models.model import ModelConfig

    gemma = arch == "gemma3"
    return ModelConfig(arch=arch, vocab_size=300, hidden_size=4 * D, intermediate_size=6 * D, num_layers=3,
                       num_heads=4, num_kv_heads=1 if gemma else 2, head_dim=D, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_seq_len=160, tie_word_embeddings=gemma,
                       attention_bias=arch == "qwen2", sliding_window=8 if gemma else 0,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"] if gemma else [],
                       query_pre_attn_scalar=float(D) if gemma else 0.0)


def check_model(dev, dtype, g, arch: str, D: int) -> float:
    """Prefill of 40 tokens, then a 12-node tree at n = 40: hidden states of the Triton path vs the reference."""
    from trtllm_microspec.models.model import Transformer

    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    model = Transformer(tiny_config(arch, D))
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.setup(dtype, dev)
    L, N = 40, 12
    ids = torch.randint(300, (L + N,), generator=g).to(dev)
    tree = random_tree(g, N).to(dev)
    depth = tree.sum(1) - 1
    err = 0.0
    outs = []
    for use in (True, False):
        model.cache.k.fill_(float("nan"))
        model.cache.v.fill_(float("nan"))
        with layers.path(use), torch.no_grad():
            pos = torch.arange(L, device=dev)
            h1 = model(ids[:L], pos, pos, Span(torch.tensor(0, device=dev), tree.new_ones(L, L).tril(), L))
            n = torch.tensor(L, device=dev)
            h2 = model(ids[L:], L + depth, L + torch.arange(N, device=dev), Span(n, tree, L + N + 8))
        outs.append((h1, h2))
    for a, b in zip(*outs):
        err = max(err, rel(a, b))
    return err


def check_model_packed(dev, dtype, g, arch: str, D: int) -> float:
    """Two packed passes as BatchRunner.pack builds them (a causal Spans over one paged pool): prompt chunks of
    three requests, then the next chunks of two with a decode row of the third, whose prompt is in. Hidden states
    of the Triton path (one attention launch a layer; Gemma's sliding layers with their window) vs the
    reference's per-part loop."""
    from trtllm_microspec.models.model import KVCache, Transformer

    from .layers import KV_BLOCK, Spans

    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    model = Transformer(tiny_config(arch, D))
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.setup(dtype, dev)
    blocks = 3
    table = torch.randperm(3 * blocks + 2, generator=g)[:3 * blocks].view(3, blocks).to(dev)
    tri = torch.ones(64, 64, dtype=torch.bool, device=dev).tril()
    # (request, committed n, rows T) per chunk, and the decodes' (request, n)
    passes = [([(0, 0, 20), (1, 0, 7), (2, 0, 33)], []), ([(0, 20, 15), (1, 7, 1)], [(2, 33)])]
    outs = []
    for use in (True, False):
        model.cache = KVCache(model.cfg, model.cfg.num_layers, dtype, dev, slots=(3 * blocks + 2) * KV_BLOCK)
        model.cache.k.fill_(float("nan"))
        model.cache.v.fill_(float("nan"))
        gen = torch.Generator().manual_seed(1)
        for chunks, decodes in passes:
            parts = [Span(torch.tensor([n], device=dev), tri[None, :T, :T], n + T, table[b:b + 1])
                     for b, n, T in chunks]
            ns = [n for _, n in decodes]
            if ns:
                parts.append(Span(torch.tensor(ns, device=dev), tri[:1, :1].expand(len(ns), 1, 1), max(ns) + 1,
                                  table[[b for b, _ in decodes]]))
            slots = torch.cat([n + torch.arange(T) for _, n, T in chunks] + [torch.tensor(ns, dtype=torch.long)])
            slots = slots.to(dev)
            ids = torch.randint(300, (slots.numel(),), generator=gen).to(dev)
            with layers.path(use), torch.no_grad():
                outs.append(model(ids, slots, slots, Spans(parts, causal=True)))
    half = len(outs) // 2
    return max(rel(a, b) for a, b in zip(outs[:half], outs[half:]))


def check_model_batched(dev, dtype, g, arch: str, D: int) -> float:
    """Three requests in one paged pool: prefill (different lengths, padded to one T with rows that see only
    themselves), then a tree of 6 per request in one batched forward, against each request run alone on a
    single-sequence cache (Triton path on both sides)."""
    from trtllm_microspec.models.model import KVCache, Transformer

    from .layers import KV_BLOCK

    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    model = Transformer(tiny_config(arch, D))
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.setup(dtype, dev)
    cfg = model.cfg
    lens, N, B = [23, 40, 9], 6, 3
    T = max(lens)
    S = T + N
    blocks = -(-S // KV_BLOCK)
    table = torch.randperm(B * blocks + 2, generator=g)[:B * blocks].view(B, blocks).to(dev)
    ids = [torch.randint(300, (L + N,), generator=g).to(dev) for L in lens]
    trees = [random_tree(g, N).to(dev) for _ in range(B)]
    with layers.path(True), torch.no_grad():
        alone = []
        for b in range(B):
            model.cache = KVCache(cfg, cfg.num_layers, dtype, dev)
            L, pos = lens[b], torch.arange(lens[b], device=dev)
            h1 = model(ids[b][:L], pos, pos, Span(torch.tensor(0, device=dev), pos.new_ones(L, L).bool().tril(), L))
            depth = trees[b].sum(1) - 1
            h2 = model(ids[b][L:], L + depth, L + torch.arange(N, device=dev),
                       Span(torch.tensor(L, device=dev), trees[b], L + N))
            alone.append((h1, h2))
        model.cache = KVCache(cfg, cfg.num_layers, dtype, dev, slots=(B * blocks + 2) * KV_BLOCK)
        model.cache.k.fill_(float("nan"))
        model.cache.v.fill_(float("nan"))
        # prefill padded to T rows each: a padding row writes its own slot past the prompt and sees only itself
        toks = torch.cat([torch.cat([ids[b][:lens[b]], ids[b].new_zeros(T - lens[b])]) for b in range(B)])
        pos = torch.arange(T, device=dev).repeat(B)
        new = torch.ones(B, T, T, dtype=torch.bool, device=dev).tril()
        for b in range(B):
            new[b, lens[b]:] = torch.eye(T, dtype=torch.bool, device=dev)[lens[b]:]
        h1 = model(toks, pos, pos, Span(torch.zeros(B, dtype=torch.long, device=dev), new, T, table))
        n = torch.tensor(lens, device=dev)
        toks = torch.cat([ids[b][lens[b]:] for b in range(B)])
        pos = torch.cat([lens[b] + trees[b].sum(1) - 1 for b in range(B)])
        slots = (n[:, None] + torch.arange(N, device=dev)).flatten()
        h2 = model(toks, pos, slots, Span(n, torch.stack(trees), S, table))
    err = 0.0
    for b in range(B):
        err = max(err, rel(h1[b * T:b * T + lens[b]], alone[b][0]), rel(h2[b * N:(b + 1) * N], alone[b][1]))
    return err


def check_packed_attention(dev, dtype, g, H: int, KV: int, D: int, chunks: list[tuple[int, int]], decodes: int,
                           S: int, window: int = 0) -> float | tuple[float, str]:
    """A step's rows as the batched engine packs them (layers.Spans): prompt chunks (committed length n, T rows)
    of their own lengths, then `decodes` requests of one row each, in one pool behind random block tables, keys
    at most window - 1 positions back when window > 0. The Triton path, the one launch of a causal Spans
    (triton_layers.attention_varlen, what the runner's passes take), the same in the layout of a graphed pass
    (padding rows, the tile list padded with empty tiles) and the per-part loop of an unflagged one, against a
    float64 attention of each request alone over its own keys."""
    from .layers import KV_BLOCK, Spans

    reqs = list(chunks) + [(int(torch.randint(0, S, (1,), generator=g)), 1) for _ in range(decodes)]
    blocks = -(-S // KV_BLOCK)
    pool = len(reqs) * blocks + 3
    table = torch.randperm(pool, generator=g)[:len(reqs) * blocks].view(len(reqs), blocks).to(dev)
    k = torch.randn(KV, pool * KV_BLOCK, D, generator=g).to(dev, dtype)
    v = torch.randn(KV, pool * KV_BLOCK, D, generator=g).to(dev, dtype)
    k_pos = torch.zeros(pool * KV_BLOCK, dtype=torch.long, device=dev)  # each slot's logical position (window)
    physes = []
    for i, (n, T) in enumerate(reqs):
        cols = torch.arange(n + T, device=dev)
        physes.append(table[i, cols // KV_BLOCK] * KV_BLOCK + cols % KV_BLOCK)
        k_pos[physes[-1]] = cols
    tri = torch.ones(S, S, dtype=torch.bool, device=dev).tril()  # chunks' masks are views of one, as the runner's
    parts = [Span(torch.tensor([n], device=dev), tri[None, :T, :T], n + T, table[i:i + 1])
             for i, (n, T) in enumerate(chunks)]
    if decodes:
        ns = torch.tensor([n for n, _ in reqs[len(chunks):]], device=dev)
        parts.append(Span(ns, tri[:1, :1].expand(decodes, 1, 1), int(ns.max()) + 1, table[len(chunks):]))
    rows = sum(T for _, T in reqs)
    q = torch.randn(rows, H, D, generator=g).to(dev, dtype)
    q_pos = torch.cat([n + torch.arange(T) for n, T in reqs]).to(dev)
    scale = D ** -0.5
    one = Spans(parts, causal=True)
    # the layout of a pass that a CUDA graph replays (engine/runner.py, pack(pad=...)): padding rows as one more
    # chunk after the others (its keys: any blocks, 0 committed), the tile list in one int64 buffer padded with empty
    # tiles of an empty sequence, the tile height fixed, every sequence's table row and length in buffers
    G, P, pad = H // KV, sum(T for _, T in chunks), 5
    padded = parts[:len(chunks)] + [Span(torch.zeros(1, dtype=torch.long, device=dev), tri[None, :pad, :pad], pad,
                                         table[:1])] + parts[len(chunks):]
    seqs, tiles = layers.varlen_layout([(1, T) for _, T in chunks] + [(1, pad), (decodes, 1)], G, 64)
    NS = len(seqs) + 2
    NT = -(-(rows + pad) * G // 64) + NS
    seqs += [(0, 0)] * (NS - len(seqs))
    tiles += [(NS - 1, 0)] * (NT - len(tiles))
    seq_n = [n for n, _ in chunks] + [0] + [n for n, _ in reqs[len(chunks):]]
    seq_n = torch.tensor(seq_n + [0] * (NS - len(seq_n)), device=dev)
    seq_rows = list(range(len(chunks))) + [0] + list(range(len(chunks), len(reqs)))
    seq_table = table[torch.tensor(seq_rows + [0] * (NS - len(seq_rows)), device=dev)]
    graph = Spans(padded, causal=True, block_m=64)
    graph._varlen[(G, 64)] = (torch.tensor(tiles, device=dev), torch.tensor(seqs, device=dev), seq_n, seq_table)
    q_graph = torch.cat([q[:P], torch.randn(pad, H, D, generator=g).to(dev, dtype), q[P:]])
    pos_graph = torch.cat([q_pos[:P], torch.arange(pad, device=dev), q_pos[P:]])
    with layers.path(True):
        got = layers.attention(q, k, v, one, q_pos, k_pos, window, scale)
        loop = layers.attention(q, k, v, Spans(parts), q_pos, k_pos, window, scale)
        by_graph = layers.attention(q_graph, k, v, graph, pos_graph, k_pos, window, scale)
    by_graph = torch.cat([by_graph[:P], by_graph[P + pad:]])
    if not one._varlen:
        return float("inf"), "the causal Spans did not run attention_varlen"
    refs, r0 = [], 0
    for (n, T), phys in zip(reqs, physes):
        cols = torch.arange(n + T, device=dev)
        t = n + torch.arange(T, device=dev)
        mask = cols[None, :] <= t[:, None]
        if window:
            mask &= (t[:, None] - cols[None, :]) < window
        refs.append(torch.nn.functional.scaled_dot_product_attention(
            q[r0:r0 + T].double().transpose(0, 1), k[:, phys].double(), v[:, phys].double(), attn_mask=mask,
            scale=scale, enable_gqa=True).transpose(0, 1))
        r0 += T
    ref = torch.cat(refs)
    return max(rel(got, ref), rel(loop, ref), rel(by_graph, ref))


def fix_interpreter() -> None:
    """Two fixes to Triton 3.6's interpreter, which alone is touched (TRITON_INTERPRET=1). It holds scalars as
    1-element arrays and converts them with int(array), which numpy >= 2.4 refuses ("only 0-dimensional
    arrays..."): a loop bound read from memory then fails on the CPU; convert through the element instead. And
    it casts float32 to bfloat16 by truncating, where the GPU (and torch) round to nearest even: each rounding
    then drifts ~0.4% low, and a kernel that rounds as often as its reference (a fused MLP's gate, up,
    activation, product and output: aa43e53) failed its bf16 tolerance on the CPU alone. Round to nearest even,
    as the hardware does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    orig = it._patch_lang_tensor

    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    it._patch_lang_tensor = patch
    cast = it.InterpreterBuilder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.asarray(src.data, dtype=np.float32)
            bits = data.view(np.uint32).astype(np.uint64)
            out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            out[np.isnan(data)] = 0x7FC0
            return it.TensorHandle(out, dst_type.scalar)
        return cast(self, src, dst_type)

    it.InterpreterBuilder.cast_impl = cast_rne


def fmt_config(config: tuple[int, int, int]) -> str:
    block_n, block_k, splits = config
    return f"{block_n}x{block_k}/{splits}"  # BLOCK_N x BLOCK_K / K splits


def cases(dev: str, big: bool, g):
    """(name, tolerance, check) in order; check() -> the error, or (error, detail shown on failure). Lazy: each
    runs (and prints) before the next is drawn."""
    dtypes = [torch.bfloat16, torch.float32] if dev == "cuda" else [torch.float32]
    shapes = [(9, 3, 64), (4, 1, 256), (12, 2, 128)] if big else [(4, 2, 32), (4, 1, 64)]
    # (bf16 rows, fp32 rows, N, K, bias, act): odd sizes (masks, splits); on a GPU two of them, then
    # qwen2.5-coder-1.5b's q|k|v, O, gate|up, down (SiLU; GELU as Gemma's) and LM head at rows that reach each
    # BLOCK_M of the kernel (16, 32, 64) with every flag combination, as few compiles as cover them (each ~0.5 s;
    # fp32, the lossless checks' dtype, at fewer)
    lin = [((1,), (1,), 37, 300, True, None), ((1,), (1,), 24, 2100, False, "silu"), ((5,), (5,), 50, 96, False, None),
           ((17,), (17,), 37, 520, False, "silu"), ((33,), (33,), 20, 300, False, "gelu"),
           ((64,), (64,), 70, 130, True, None), ((16,), (16,), 16, 64, False, None)]
    if big:
        lin = [((17,), (17,), 37, 520, False, "silu"), ((64,), (), 70, 130, True, None),
               ((1, 24, 60), (1, 60), 2048, 1536, True, None), ((1, 60), (), 1536, 1536, False, None),
               ((1, 24, 60), (), 17920, 1536, False, None), ((1, 24, 60), (1, 60), 1536, 8960, False, "silu"),
               ((1, 60), (), 1536, 8960, False, "gelu"), ((1, 60), (60,), 151936, 1536, False, None)]
    # (bf16 rows, fp32 rows, N, K, bias, delta, offset): the add + RMSNorm in the q|k|v and gate|up prologue
    nl = [((1,), (1,), 37, 300, True, True, 0.0), ((17,), (17,), 50, 520, False, True, 1.0),
          ((33,), (33,), 20, 96, False, False, 0.0)]
    if big:
        nl = [((17,), (17,), 50, 520, False, True, 1.0), ((1, 24, 60), (1,), 2048, 1536, True, True, 0.0),
              ((1, 60), (), 17920, 1536, False, True, 0.0), ((1,), (), 2048, 1536, True, False, 1.0)]
    # (bf16 rows, fp32 rows, H, KV, D, K, bias, delta): + the rotation and KV write in the q|k|v epilogue
    rq = [((1,), (1,), 4, 2, 32, 128, True, True), ((17,), (17,), 3, 1, 64, 256, False, True),
          ((5,), (), 2, 1, 16, 64, True, False)]
    if big:
        rq = [((1, 24, 60), (1, 60), 12, 2, 128, 1536, True, True), ((1,), (), 9, 3, 64, 576, False, False)]
    from .triton_layers import skinny_configs

    def configs(m, N, K, dtype):
        return " ".join(fmt_config(c) for c in skinny_configs(m, N, K, dtype == torch.float32))

    for dtype in dtypes:
        for L, KV, D, P in ([(28, 2, 128, 6), (3, 4, 64, 8)] if big else [(3, 2, 32, 6)]):
            yield (f"move_slots L={L} KV={KV} D={D} P={P} {str(dtype).removeprefix('torch.')}", 0.0,
                   lambda L=L, KV=KV, D=D, P=P, dtype=dtype: check_move(dev, dtype, g, L, KV, D, P))
    # (B, V, R, F): a MicroSpec window's fill at qwen2.5's vocabulary, a batch, a fill longer than a block
    for B, V, R, F in ([(1, 151936, 3072, 3072), (8, 151936, 3072, 3072), (3, 5000, 300, 2500)] if big else
                       [(1, 400, 64, 64), (4, 400, 64, 64), (3, 3000, 40, 1500)]):
        yield (f"window_fill B={B} V={V} R={R} F={F}", 0.0,
               lambda B=B, V=V, R=R, F=F: check_window_fill(dev, g, B, V, R, F))
    # (B, k, depth, N): the GPU's tree, the CPU's, an odd small one, one of depth 1 (no expansion's inputs)
    for B, k, depth, N in [(1, 10, 5, 60), (3, 10, 5, 60), (2, 4, 3, 12), (3, 3, 2, 7), (2, 4, 1, 10)]:
        yield (f"tree_select B={B} k={k} depth={depth} N={N}", 0.0,
               lambda B=B, k=k, depth=depth, N=N: check_tree_select(dev, g, B, k, depth, N))
    for B, k, depth, N in [(1, 10, 5, 60), (4, 10, 5, 60), (5, 4, 3, 12), (3, 2, 1, 3)]:
        yield (f"tree_accept B={B} k={k} depth={depth} N={N}", 0.0,
               lambda B=B, k=k, depth=depth, N=N: check_tree_accept(dev, g, B, k, depth, N))
    for dtype in dtypes:
        for B, k, depth, d in [(3, 10, 5, 1536 if big else 96), (2, 3, 3, 40)]:
            yield (f"tree_grow B={B} k={k} depth={depth} d={d} {str(dtype).removeprefix('torch.')}", 0.0,
                   lambda B=B, k=k, depth=depth, d=d, dtype=dtype: check_tree_grow(dev, dtype, g, B, k, depth, d))
    # (rows, vocabulary, k): the LM head's top-K_pre / K_ver / k_tree rows; a vocabulary 4,096 does not divide
    tk = [(60, 151936, 10), (512, 151936, 3), (1, 151936, 3), (7, 100003, 3)] if big else \
         [(9, 12345, 3), (2, 20480, 10), (1, 3100, 3)]
    for dtype in dtypes:
        for T, V, k in tk:
            yield (f"vocab top-k T={T} V={V} k={k} {str(dtype).removeprefix('torch.')}", 0.0,
                   lambda T=T, V=V, k=k, dtype=dtype: check_topk(dev, dtype, g, T, V, k))
    for dtype in (torch.bfloat16, torch.float32):  # bf16 under the interpreter too (fix_interpreter rounds as the GPU)
        dn = str(dtype).removeprefix("torch.")
        for rows16, rows32, N, K, bias, act in lin:
            for m in rows16 if dtype == torch.bfloat16 else rows32:
                def check(m=m, N=N, K=K, bias=bias, act=act, dtype=dtype):
                    errs = check_linear(dev, dtype, g, m, N, K, bias, act)
                    return max(e for _, e in errs), " ".join(f"{fmt_config(c)}: {e:.1e}" for c, e in errs)

                yield (f"skinny linear M={m} N={N} K={K} bias={bias} act={act} {dn} configs "
                       f"{configs(m, N, K, dtype)}", TOL[dtype], check)
    for dtype in (torch.bfloat16, torch.float32):
        dn = str(dtype).removeprefix("torch.")
        for rows16, rows32, N, K, bias, delta, offset in nl:
            for m in rows16 if dtype == torch.bfloat16 else rows32:
                def check(m=m, N=N, K=K, bias=bias, delta=delta, offset=offset, dtype=dtype):
                    errs = check_norm_linear(dev, dtype, g, m, N, K, bias, delta, offset)
                    return max(e for _, e in errs), " ".join(f"{fmt_config(c)}: {e:.1e}" for c, e in errs)

                yield (f"norm_linear (add + RMSNorm in the skinny GEMM) M={m} N={N} K={K} bias={bias} add={delta} "
                       f"offset={offset:g} {dn} configs {configs(m, N, K, dtype)}", TOL[dtype], check)
        for rows16, rows32, H, KV, D, K, bias, delta in rq:
            for m in rows16 if dtype == torch.bfloat16 else rows32:
                def check(m=m, H=H, KV=KV, D=D, K=K, bias=bias, delta=delta, dtype=dtype):
                    errs = check_norm_qkv_rope(dev, dtype, g, m, H, KV, D, K, bias, delta)
                    return max(e for _, e in errs), " ".join(f"{fmt_config(c)}: {e:.1e}" for c, e in errs)

                fits = " ".join(fmt_config(c) for c in skinny_configs(m, (H + 2 * KV) * D, K,
                                                                      dtype == torch.float32) if D % c[0] == 0)
                yield (f"norm_linear + rope_cache_write (skinny GEMM) M={m} H={H}/{KV} D={D} K={K} bias={bias} "
                       f"add={delta} {dn} configs {fits}", TOL[dtype], check)
    for dtype in dtypes:
        tol = TOL[dtype]
        dn = str(dtype).removeprefix("torch.")
        for d in ([576, 640, 1536] if big else [96, 128]):
            yield f"add_rms_norm, rms_norm and norm_cat d={d} {dn}", tol, lambda d=d: check_norm(dev, dtype, g, d)
        yield f"act_mul {dn}", tol, lambda: check_act(dev, dtype, g, 8960 if big else 200)
        for H, KV, D in shapes:
            yield (f"rope_cache_write H={H} KV={KV} D={D} {dn}", tol,
                   lambda H=H, KV=KV, D=D: check_rope(dev, dtype, g, H, KV, D, False))
        yield f"rope_cache_write qk-norm {dn}", tol, lambda: check_rope(dev, dtype, g, 4, 1, shapes[1][2], True)
        attn = [(1, 500, 1024, 0, "causal"), (60, 700, 1024, 0, "tree"), (10, 300, 512, 0, "draft"),
                (600, 0, 600, 0, "causal"), (60, 400, 512, 128, "tree"), (1, 900, 1024, 512, "causal")] if big else \
               [(1, 37, 64, 0, "causal"), (12, 20, 48, 0, "tree"), (5, 9, 40, 0, "draft"), (33, 0, 33, 0, "causal"),
                (12, 30, 64, 16, "tree"), (1, 150, 256, 0, "causal"), (4, 100, 192, 0, "draft")]  # last two: split
        for H, KV, D in shapes:
            for T, n, S, w, kind in attn:
                yield (f"attention {kind} T={T} n={n} S={S} window={w} H={H}/{KV} D={D} {dn}", tol,
                       lambda H=H, KV=KV, D=D, T=T, n=n, S=S, w=w, kind=kind:
                       check_attention(dev, dtype, g, H, KV, D, T, n, S, w, kind))
        # other plans than attention_plan's (the sweep's): splits of the request's own span, more splits than
        # key blocks, one split, every block size
        plans = [(64, 64, 16, 8), (16, 32, 1, 2), (32, 128, 5, 4), (128, 64, 3, 8), (16, 32, 8, 4, True),
                 (32, 64, 3, 4, True)] if big else \
                [(16, 16, 7, 4), (32, 32, 1, 2), (16, 16, 2, 1), (16, 16, 7, 4, True), (16, 32, 3, 2, True)]
        for plan in plans:
            T, n, S = (60, 700, 1024) if big else (12, 40, 64)
            yield (f"attention tree T={T} n={n} S={S} plan={plan} H={shapes[0][0]}/{shapes[0][1]} {dn}", tol,
                   lambda T=T, n=n, S=S, plan=plan: check_attention(dev, dtype, g, *shapes[0], T, n, S, 0, "tree",
                                                                    plan=plan))
        for T, n, S in ([(600, 0, 600), (700, 300, 1000)] if big else [(40, 0, 40), (30, 10, 40)]):  # long chunks
            yield (f"reference attention causal T={T} n={n} S={S} H={shapes[0][0]}/{shapes[0][1]} {dn}", tol,
                   lambda T=T, n=n, S=S: check_attention(dev, dtype, g, *shapes[0], T, n, S, 0, "causal", False))
        paged = [(4, 1, 200, 0, "causal"), (3, 12, 300, 0, "tree"), (5, 7, 250, 64, "causal")] if big else \
                [(3, 1, 70, 0, "causal"), (2, 6, 40, 0, "tree"), (3, 5, 50, 16, "causal")]
        for H, KV, D in shapes[:2]:
            for B, T, S, w, kind in paged:
                yield (f"paged attention {kind} B={B} T={T} S={S} window={w} H={H}/{KV} D={D} {dn}", tol,
                       lambda H=H, KV=KV, D=D, B=B, T=T, S=S, w=w, kind=kind:
                       check_paged_attention(dev, dtype, g, H, KV, D, B, T, S, w, kind))
        # the decode plans attention_choice measures for big batches (the kernel alone, each plan)
        from .triton_layers import DECODE_PLANS
        B, S = (8, 600) if big else (3, 70)
        for plan in DECODE_PLANS + tuple((*p, True) for p in DECODE_PLANS if p[2] > 1):
            yield (f"paged attention decode B={B} S={S} plan={plan} H={shapes[0][0]}/{shapes[0][1]} {dn}", tol,
                   lambda B=B, S=S, plan=plan: check_paged_attention(dev, dtype, g, *shapes[0], B, 1, S, 0, "causal",
                                                                     plan))
        # (chunks (n, T), decodes, S, window): chunks of their own lengths, long ones (>= LONG_ROWS) among them
        packed = [([(0, 600), (300, 40)], 70, 1024, 0), ([(900, 100)], 200, 1024, 0),
                  ([(0, 512), (512, 512), (100, 37), (0, 1), (700, 600), (30, 129)] + [(64 * i, 64) for i in range(8)],
                   256, 1400, 0), ([(0, 600), (200, 64), (0, 7)], 30, 1024, 128)] if big else \
                 [([(0, 9), (20, 5)], 3, 48, 0), ([(7, 1)], 4, 40, 0),
                  ([(0, 20), (5, 1), (30, 12), (0, 3), (17, 33)], 5, 64, 0), ([(0, 20), (10, 7)], 2, 40, 8)]
        for H, KV, D in shapes[:2]:
            for chunks, dec, S, w in packed:
                yield (f"packed attention chunks={chunks} decodes={dec} S={S} window={w} H={H}/{KV} D={D} {dn}", tol,
                       lambda H=H, KV=KV, D=D, chunks=chunks, dec=dec, S=S, w=w:
                       check_packed_attention(dev, dtype, g, H, KV, D, chunks, dec, S, w))
        for arch in ("llama", "qwen2", "gemma3"):
            D = 64 if big else 32
            yield f"model {arch} prefill+tree {dn}", tol, lambda arch=arch: check_model(dev, dtype, g, arch, D)
            yield (f"model {arch} batched paged prefill+tree {dn}", tol,
                   lambda arch=arch: check_model_batched(dev, dtype, g, arch, D))
            yield (f"model {arch} packed chunks+decodes {dn}", tol,
                   lambda arch=arch: check_model_packed(dev, dtype, g, arch, D))


def selected(name: str, only: list[str] | None) -> bool:
    return not only or any(o in name for o in only)


def warm(dev: str, big: bool, only: list[str] | None, jobs: int) -> None:
    """Run the skinny GEMM checks (its ~100 compiled variants, ~0.5 s of compiling each) spread over `jobs`
    processes first, silently: Triton's disk cache keeps what they compile, so the checks after find it built.
    A worker that fails costs only time (the checks compile what is missing themselves)."""
    import subprocess
    import time

    t0 = time.perf_counter()
    args = [sys.executable, "-m", "plugins.check_layers", "--device", dev] + ([] if big else ["--small"])
    args += ["--only", *only] if only else []
    procs = [subprocess.Popen(args + ["--warm", f"{i}/{jobs}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for i in range(jobs)]
    bad = [p.communicate()[1].strip().splitlines()[-1:] for p in procs if p.wait() != 0]
    print(f"...   skinny GEMM variants compiled in {jobs} processes in {time.perf_counter() - t0:.0f} s"
          + (f" ({len(bad)} failed: {bad[0]})" if bad else ""), flush=True)


def run(dev: str, big: bool, only: list[str] | None = None, jobs: int = 1, part: tuple[int, int] | None = None) -> int:
    """Each check printed as it finishes (with its seconds: the first use of a kernel variant compiles it); a
    check still running after 30 s says so every 30 s (a hang shows where it is). jobs > 1: the skinny GEMM's
    variants are compiled in that many processes first (warm). part (i, n): a warm worker, which runs only
    every n-th skinny GEMM check from the i-th and prints nothing."""
    import threading
    import time

    if os.environ.get("TRITON_INTERPRET") == "1":
        fix_interpreter()
    g = torch.Generator().manual_seed(0)
    if part is not None:
        todo = [c for c in cases(dev, big, g) if "skinny" in c[0] and selected(c[0], only)]
        for _, _, check in todo[part[0]::part[1]]:
            check()
        return 0
    if jobs > 1 and any("skinny" in name and selected(name, only) for name, _, _ in cases(dev, big, g)):
        warm(dev, big, only, jobs)
    done = fails = 0
    t_all = time.perf_counter()
    now = {"name": None, "t0": 0.0}
    stop = threading.Event()

    def watch():  # a plain thread, no faulthandler: dumping a running thread's stack can crash the interpreter
        while not stop.wait(30):
            if now["name"] and time.perf_counter() - now["t0"] > 30:
                print(f"...   still running after {time.perf_counter() - now['t0']:.0f} s: {now['name']}",
                      flush=True)

    threading.Thread(target=watch, daemon=True).start()
    try:
        for name, tol, check in cases(dev, big, g):
            if not selected(name, only):
                continue
            now["name"], now["t0"] = name, time.perf_counter()
            got = check()
            err, detail = got if isinstance(got, tuple) else (got, "")
            if dev == "cuda":
                torch.cuda.synchronize()
            ok = err <= tol
            done, fails = done + 1, fails + (not ok)
            secs = time.perf_counter() - now["t0"]
            print(f"{'PASS' if ok else 'FAIL'}  {err:9.2e} <= {tol:.0e}  {name}  ({secs:.1f} s)"
                  + ("" if ok or not detail else f"\n      per config: {detail}"), flush=True)
            now["name"] = None
    finally:
        stop.set()
    print(f"{done - fails} of {done} passed in {time.perf_counter() - t_all:.0f} s", flush=True)
    return 1 if fails or not done else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="small shapes only (the CPU interpreter's)")
    p.add_argument("--only", nargs="+", metavar="TEXT", help="only the checks whose name contains one of these "
                   "(e.g. 'skinny linear', 'attention', 'model')")
    p.add_argument("--jobs", type=int, default=min(8, (os.cpu_count() or 2) // 2),
                   help="GPU: processes that compile the skinny GEMM's variants first (1: none)")
    p.add_argument("--warm", help=argparse.SUPPRESS)  # "i/n": one of warm()'s workers
    a = p.parse_args()
    part = tuple(int(v) for v in a.warm.split("/")) if a.warm else None
    return run(a.device, big=a.device == "cuda" and not a.small, only=a.only,
               jobs=a.jobs if a.device == "cuda" else 1, part=part)


if __name__ == "__main__":
    sys.exit(main())
