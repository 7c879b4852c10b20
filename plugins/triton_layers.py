"""Triton kernels for the decoder layer (CUDA; plugins/layers.py holds the torch reference of each and calls
these). They round where the reference rounds (to the activations' dtype after each op), so the fast path and
the reference differ only by the order of float additions. No host reads: every launch is sized by static
shapes and reads device scalars (the span's committed length n) inside the kernel, so steps stay capturable in
CUDA graphs and one captured step serves every n.

Per layer: add+RMSNorm, [QKV GEMM], rotary+cache write, attention (+ a combine when the span is split),
[O GEMM], add+RMSNorm, [gate|up GEMM], activation, [down GEMM]: 9-10 launches. The bracketed GEMMs are cuBLAS
or, at 1-64 rows where it measured faster, the skinny GEMM below (one launch, split K included); its down
projection applies the activation itself, and its q|k|v and gate|up projections can take the add + RMSNorm
before them into their prologue and q|k|v the rotation + KV write after it into its epilogue
(skinny_norm_linear), each fold one launch fewer: 5 launches a layer (+ attention's combine) when every fold
is picked."""
from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def _rms(x, w_ptr, cols, col_ok, n_cols, eps, offset):
    var = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return x * tl.rsqrt(var + eps) * (offset + w)


@triton.jit
def _add_rms_norm_kernel(res_ptr, delta_ptr, w_ptr, dw_ptr, res_out_ptr, h_ptr, n_cols, eps, offset,
                         HAS_DELTA: tl.constexpr, NORM_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(res_ptr + row * n_cols + cols, mask=ok, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        if NORM_DELTA:
            d = _rms(d, dw_ptr, cols, ok, n_cols, eps, offset).to(dtype).to(tl.float32)
        x = (x + d).to(dtype).to(tl.float32)
        tl.store(res_out_ptr + row * n_cols + cols, x.to(dtype), mask=ok)
    tl.store(h_ptr + row * n_cols + cols, _rms(x, w_ptr, cols, ok, n_cols, eps, offset).to(dtype), mask=ok)


def add_rms_norm(res, delta, w, eps, offset, delta_w=None):
    import torch

    T, d = res.shape
    assert res.is_contiguous() and (delta is None or delta.is_contiguous())
    h = torch.empty_like(res)
    out = torch.empty_like(res) if delta is not None else res
    _add_rms_norm_kernel[(T,)](res, delta if delta is not None else res, w, delta_w if delta_w is not None else w,
                               out, h, d, eps, offset, HAS_DELTA=delta is not None, NORM_DELTA=delta_w is not None,
                               BLOCK=triton.next_power_of_2(d), num_warps=4 if d <= 2048 else 8)
    return out, h


@triton.jit
def _norm_cat_kernel(a_ptr, rows_ptr, b_ptr, wa_ptr, wb_ptr, out_ptr, n_cols, eps, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """out[row] = [rms_norm(a[row]) * wa | rms_norm(b[row]) * wb], rounded as rms_norm rounds each; ROWS: a's row
    is a[rows[row]] (a table gathered)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    a_row = tl.load(rows_ptr + row).to(tl.int64) if ROWS else row
    a = tl.load(a_ptr + a_row * n_cols + cols, mask=ok, other=0.0)
    b = tl.load(b_ptr + row * n_cols + cols, mask=ok, other=0.0)
    out = out_ptr + row * 2 * n_cols + cols
    tl.store(out, _rms(a.to(tl.float32), wa_ptr, cols, ok, n_cols, eps, 0.0).to(a.dtype), mask=ok)
    tl.store(out + n_cols, _rms(b.to(tl.float32), wb_ptr, cols, ok, n_cols, eps, 0.0).to(a.dtype), mask=ok)


def norm_cat(a, b, wa, wb, eps, rows=None):
    import torch

    T, d = b.shape
    assert a.is_contiguous() and b.is_contiguous() and a.shape[1] == d and b.dtype == a.dtype
    assert rows is None and a.shape[0] == T or rows is not None and rows.is_contiguous() and rows.numel() == T
    out = torch.empty(T, 2 * d, dtype=a.dtype, device=a.device)
    _norm_cat_kernel[(T,)](a, b if rows is None else rows, b, wa, wb, out, d, eps, ROWS=rows is not None,
                           BLOCK=triton.next_power_of_2(d), num_warps=4 if d <= 2048 else 8)
    return out


@triton.jit
def _window_fill_kernel(slot_of_ptr, id_of_ptr, ids_ptr, batch_ptr, out_ptr, V1, R1, R, F, BLOCK: tl.constexpr):
    """layers.window_fill for request b (its window in slot batch[b]): the free slots, then the ranked fill ids
    in blocks, a running count of those outside the window carried from block to block."""
    b = tl.program_id(0)
    slot = tl.load(batch_ptr + b).to(tl.int64)
    held = 0
    for i0 in range(0, R, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        held += tl.sum((tl.load(id_of_ptr + slot * R1 + i, mask=i < R, other=-1) >= 0).to(tl.int32), axis=0)
    free = R - held
    taken = 0  # fill ids outside the window so far, in rank order
    for f0 in range(0, F, BLOCK):
        f = f0 + tl.arange(0, BLOCK)
        ok = f < F
        ids = tl.load(ids_ptr + f, mask=ok, other=0)
        outside = (tl.load(slot_of_ptr + slot * V1 + ids, mask=ok, other=0) < 0) & ok
        rank = taken + tl.cumsum(outside.to(tl.int32), axis=0)
        tl.store(out_ptr + b * F + f, tl.where(outside & (rank <= free), ids, -1), mask=ok)
        taken += tl.sum(outside.to(tl.int32), axis=0)


def window_fill(slot_of, id_of, fill_ids, batch, R):
    import torch

    B, F = batch.numel(), fill_ids.numel()
    assert slot_of.is_contiguous() and id_of.is_contiguous() and fill_ids.is_contiguous() and batch.is_contiguous()
    out = torch.empty(B, F, dtype=fill_ids.dtype, device=fill_ids.device)
    if B and F:
        _window_fill_kernel[(B,)](slot_of, id_of, fill_ids, batch, out, slot_of.shape[1], id_of.shape[1], R, F,
                                  BLOCK=1024, num_warps=4)
    return out


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr,
                       H, KV, stride_pos, stride_slot, stride_kh, stride_ks, eps,
                       D: tl.constexpr, QK_NORM: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1: a q head; H..H+KV-1: a k head (and its v head)
    half = tl.arange(0, D // 2)
    pos = tl.load(pos_ptr + t * stride_pos)  # strided: the draft passes one position expanded over its rows
    row = qkv_ptr + t * (H + 2 * KV) * D + head * D
    x1 = tl.load(row + half)
    x2 = tl.load(row + D // 2 + half)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if QK_NORM:  # Gemma: a (1 + w) RMSNorm over the head, rounded, then rotated
        is_q = head < H
        w1 = tl.where(is_q, tl.load(qn_ptr + half), tl.load(kn_ptr + half)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + D // 2 + half), tl.load(kn_ptr + D // 2 + half)).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        x1 = (x1 * r * (1.0 + w1)).to(dtype).to(tl.float32)
        x2 = (x2 * r * (1.0 + w2)).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + pos * (D // 2) + half)
    s = tl.load(sin_ptr + pos * (D // 2) + half)
    y1 = (x1 * c - x2 * s).to(dtype)
    y2 = (x2 * c + x1 * s).to(dtype)
    if head < H:
        out = q_ptr + (t * H + head) * D
        tl.store(out + half, y1)
        tl.store(out + D // 2 + half, y2)
    else:
        slot = tl.load(slot_ptr + t * stride_slot)
        kv = head - H
        dst = kv * stride_kh + slot * stride_ks
        tl.store(k_ptr + dst + half, y1)
        tl.store(k_ptr + dst + D // 2 + half, y2)
        v = qkv_ptr + t * (H + 2 * KV) * D + (H + KV + kv) * D
        full = tl.arange(0, D)
        tl.store(v_ptr + dst + full, tl.load(v + full))


def rope_cache_write(qkv, heads, kv_heads, rope, positions, slots, k_cache, v_cache, qk_norm, eps):
    import torch

    T, D = qkv.shape[0], k_cache.shape[-1]
    assert qkv.is_contiguous() and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = torch.empty(T, heads, D, dtype=qkv.dtype, device=qkv.device)
    qn, kn = qk_norm if qk_norm is not None else (qkv, qkv)
    _rope_cache_kernel[(T, heads + kv_heads)](qkv, rope[0], rope[1], positions, slots, q, k_cache, v_cache, qn, kn,
                                              heads, kv_heads, positions.stride(0), slots.stride(0),
                                              k_cache.stride(0), k_cache.stride(1), eps,
                                              D=D, QK_NORM=qk_norm is not None, num_warps=1 if D <= 128 else 2)
    return q


@triton.jit
def _move_slots_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, P, stride_src, stride_dst, stride_lh, stride_s,
                       D: tl.constexpr, BLOCK_P: tl.constexpr):
    lh = tl.program_id(0)  # one (layer, kv head) of the pool
    b = tl.program_id(1)  # one request's P slots: its sources and destinations may overlap, so each program
    # reads all of its rows before it writes any; no other program touches its (layer, head, request) slots
    i = tl.arange(0, BLOCK_P)
    d = tl.arange(0, D)
    ok = i < P
    src = tl.load(src_ptr + b * stride_src + i, mask=ok, other=0)
    dst = tl.load(dst_ptr + b * stride_dst + i, mask=ok, other=0)
    base = lh.to(tl.int64) * stride_lh  # the pool spans more than 2^31 elements: 64-bit offsets
    at_src = base + src[:, None] * stride_s + d[None, :]
    at_dst = base + dst[:, None] * stride_s + d[None, :]
    kr = tl.load(k_ptr + at_src, mask=ok[:, None])
    vr = tl.load(v_ptr + at_src, mask=ok[:, None])
    tl.debug_barrier()  # every thread's reads done before any write
    tl.store(k_ptr + at_dst, kr, mask=ok[:, None])
    tl.store(v_ptr + at_dst, vr, mask=ok[:, None])


def move_slots(k_cache, v_cache, src, dst):
    """layers.move_slots in one launch: a program per (layer, kv head) and request."""
    L, KV, S, D = k_cache.shape
    B, P = src.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    # src / dst may be column slices of one [B, 2P] index (the round's): read in place by their row strides
    src, dst = (x if x.stride(1) == 1 else x.contiguous() for x in (src, dst))
    _move_slots_kernel[(L * KV, B)](k_cache, v_cache, src, dst, P, src.stride(0), dst.stride(0), k_cache.stride(1),
                                    k_cache.stride(2), D=D, BLOCK_P=triton.next_power_of_2(P), num_warps=1)


@triton.jit
def _tree_grow_kernel(cur_ptr, logp_ptr, ids_ptr, h_ptr, anc_ptr, eye_ptr, score_ptr, best_ptr, tok_ptr, top_ptr,
                      feat_ptr, anc_out_ptr, d, S, K: tl.constexpr, KK_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
                      D_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr):
    b = tl.program_id(0)  # one request
    j = tl.arange(0, KK_BLOCK)  # its k x k children, parent row j // K
    ok = j < K * K
    # path scores added in fp32 and rounded to the scores' dtype, as torch adds
    s = (tl.load(cur_ptr + b * K + j // K, mask=ok, other=0.0).to(tl.float32)
         + tl.load(logp_ptr + b * K * K + j, mask=ok, other=0.0).to(tl.float32)).to(score_ptr.dtype.element_ty)
    tl.store(score_ptr + b * K * K + j, s, mask=ok)
    s = s.to(tl.float32)
    s = tl.where(s == s, s, float("-inf"))  # NaN (a padding row's garbage) ranks as -inf: ranks stay a permutation
    # each child's rank: the children before it, by higher score, equal scores by lower index (a strict order:
    # ranks 0 .. k k - 1, each once); the top-k are ranks 0 .. k - 1, largest first as torch.topk's
    before = ((s[:, None] > s[None, :]) | ((s[:, None] == s[None, :]) & (j[:, None] < j[None, :]))) & ok[:, None]
    rank = tl.sum(before.to(tl.int32), axis=0)
    r = tl.arange(0, K_BLOCK)
    rok = r < K
    best = tl.sum(tl.where((rank[:, None] == r[None, :]) & ok[:, None], j[:, None], 0), axis=0)  # rank r's child
    tl.store(best_ptr + b * K + r, best, mask=rok)
    row = best // K
    tl.store(tok_ptr + b * K + r, tl.load(ids_ptr + b * K * K + best, mask=rok), mask=rok)
    top = (tl.load(cur_ptr + b * K + row, mask=rok).to(tl.float32)  # the same sum again: no read-back of s
           + tl.load(logp_ptr + b * K * K + best, mask=rok).to(tl.float32)).to(top_ptr.dtype.element_ty)
    tl.store(top_ptr + b * K + r, top, mask=rok)
    for d0 in range(0, d, D_BLOCK):  # the parents' draft hiddens
        cols = d0 + tl.arange(0, D_BLOCK)
        m = rok[:, None] & (cols[None, :] < d)
        x = tl.load(h_ptr + (b * K + row[:, None]) * d + cols[None, :], mask=m)
        tl.store(feat_ptr + (b * K + r[:, None]) * d + cols[None, :], x, mask=m)
    c = tl.arange(0, S_BLOCK)  # their ancestor rows | their own bit
    m = rok[:, None] & (c[None, :] < S)
    a = tl.load(anc_ptr + (b * K + row[:, None]) * S + c[None, :], mask=m, other=0) \
        | tl.load(eye_ptr + r[:, None] * S + c[None, :], mask=m, other=0)
    tl.store(anc_out_ptr + (b * K + r[:, None]) * S + c[None, :], a, mask=m)


def tree_grow(cur_score, logp, ids, h, anc, step_eye):
    """layers.tree_grow in one launch: a program per request ranks its k x k children in one tile."""
    import torch

    B, k = ids.shape[:2]
    d, S = h.shape[-1], anc.shape[-1]
    cur_score, logp, ids, h, anc, step_eye = (x.contiguous() for x in (cur_score, logp, ids, h, anc, step_eye))
    dev, dtype = h.device, torch.result_type(cur_score, logp)
    score, top = torch.empty(B, k * k, dtype=dtype, device=dev), torch.empty(B, k, dtype=dtype, device=dev)
    best, tok = (torch.empty(B, k, dtype=t, device=dev) for t in (torch.long, ids.dtype))
    feat, anc_out = h.new_empty(B, k, d), torch.empty_like(anc)
    _tree_grow_kernel[(B,)](cur_score, logp, ids, h, anc.view(torch.uint8), step_eye.view(torch.uint8), score, best,
                            tok, top, feat, anc_out.view(torch.uint8), d, S, K=k,
                            KK_BLOCK=triton.next_power_of_2(k * k), K_BLOCK=triton.next_power_of_2(k),
                            D_BLOCK=min(triton.next_power_of_2(d), 1024), S_BLOCK=triton.next_power_of_2(S),
                            num_warps=4)
    return score, best, tok, top, feat, anc_out


_PAD_KEY = tl.constexpr(-9223372036854775807)  # below every _desc_key (whose least is -inf's at the largest slot)
_MAX_KEY = tl.constexpr(9223372036854775807)  # above every _desc_key


@triton.jit
def _desc_key(x, slot):
    """One int64 per candidate ordering float x first (NaN excluded: the callers map it to -inf) and, among equal
    x, the lower slot first: the float's bits made order-preserving as a signed int32 (high half) and the slot's
    complement in 32 bits (low half). -0.0 counts as 0.0."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (hi.to(tl.int64) << 32) | (4294967295 - slot.to(tl.int64))


VOCAB_CHUNK = 4096  # vocab_top's ids a program: qwen2's 151,936 are 38 chunks a row


@triton.jit
def _vocab_top_chunk_kernel(x_ptr, stride_x, V, key_ptr, C, K: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1: one program per (row, chunk of BLOCK ids) keeps its chunk's k best as _desc_keys (value, then the
    lower id), one max-reduction a pick."""
    row, c = tl.program_id(0), tl.program_id(1)
    ids = c * BLOCK + tl.arange(0, BLOCK)
    ok = ids < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + ids, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN (a padding row's garbage) ranks as -inf
    key = tl.where(ok, _desc_key(x, ids), _PAD_KEY)
    out = key_ptr + (row.to(tl.int64) * C + c) * K
    for r in tl.static_range(K):
        best = tl.max(key, axis=0)
        tl.store(out + r, best)
        key = tl.where(key == best, _PAD_KEY, key)  # keys are unique (the id is in each): exactly one taken


@triton.jit
def _vocab_top_merge_kernel(x_ptr, stride_x, key_ptr, n, val_ptr, id_ptr, K: tl.constexpr, N_BLOCK: tl.constexpr):
    """Pass 2: one program per row picks the k best of its chunks' n = chunks x k keys, largest first, and reads
    each one's value back from the row (the exact logit, in its dtype)."""
    row = tl.program_id(0)
    j = tl.arange(0, N_BLOCK)
    key = tl.load(key_ptr + row.to(tl.int64) * n + j, mask=j < n, other=_PAD_KEY)
    for r in tl.static_range(K):
        best = tl.max(key, axis=0)
        i = 4294967295 - (best & 4294967295)  # the id in the key's low half
        tl.store(id_ptr + row * K + r, i)
        tl.store(val_ptr + row * K + r, tl.load(x_ptr + row.to(tl.int64) * stride_x + i))
        key = tl.where(key == best, _PAD_KEY, key)


def vocab_top(logits, k):
    """layers.vocab_topk in two launches: each row's k largest (values, ids), largest first and, among equal
    values, the lower id first (so the first is torch.argmax's); one read of the logits."""
    import torch

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    T, V = logits.shape
    C = triton.cdiv(V, VOCAB_CHUNK)
    keys = torch.empty(T, C * k, dtype=torch.int64, device=logits.device)
    vals = torch.empty(T, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.long, device=logits.device)
    if T == 0:
        return vals, ids
    _vocab_top_chunk_kernel[(T, C)](logits, logits.stride(0), V, keys, C, K=k, BLOCK=VOCAB_CHUNK, num_warps=8)
    _vocab_top_merge_kernel[(T,)](logits, logits.stride(0), keys, C * k, vals, ids, K=k,
                                  N_BLOCK=triton.next_power_of_2(C * k), num_warps=4)
    return vals, ids


@triton.jit
def _pool_parent(x, best_row, P, K: tl.constexpr):
    """Pool indices -> their parents' (tree_select's layout); the first level's and the sink P's: P."""
    lvl = (x - K + K * K) // (K * K)  # 0: the first level; L >= 1: expansion L - 1's children (x >= K)
    up = (x - K - (lvl - 1) * K * K) // K  # which of that expansion's k inputs
    inp = tl.load(best_row + (lvl - 2) * K + up, mask=(lvl >= 2) & (x < P), other=0)
    return tl.where((x < K) | (x >= P), P, tl.where(lvl == 1, up, K + (lvl - 2) * K * K + inp))


@triton.jit
def _tree_select_kernel(root_ptr, tok_ptr, score_ptr, best_ptr, pen_ptr, tree_of_ptr, pool_of_ptr, tok_out_ptr,
                        par_out_ptr, depth_out_ptr, anc_out_ptr, P, best_stride, K: tl.constexpr, N: tl.constexpr,
                        LEVELS: tl.constexpr, P_BLOCK: tl.constexpr, N_TOP: tl.constexpr, N_BLOCK: tl.constexpr):
    b = tl.program_id(0)  # one request
    j = tl.arange(0, P_BLOCK)  # its pool, and lane P: the sink (the root)
    ok = j < P
    key = tl.load(score_ptr + b * P + j, mask=ok, other=0.0).to(tl.float32) - tl.load(pen_ptr + j, mask=ok, other=0.0)
    key = tl.where(key == key, key, float("-inf"))  # NaN (a padding row's garbage) ranks as -inf, as in tree_grow
    # the best N-1 nodes: higher key first, equal keys by lower pool index (a parent's key is >= its child's and
    # its index lower, so a parent always ranks first). One int64 key per node orders both (_desc_key); the
    # (N-1)-th largest, from a bitonic top-k in registers, is the threshold (an all-pairs rank over the pool took
    # 80-87 us a round on the H200 and the H100, this 46: a serial tail in one program per request)
    ikey = tl.where(ok, _desc_key(key, j), _PAD_KEY)
    top = tl.topk(ikey, N_TOP)
    thr = tl.min(tl.where(tl.arange(0, N_TOP) < N - 1, top, _MAX_KEY), axis=0)
    chosen = ok & (ikey >= thr)
    t = tl.cumsum(chosen.to(tl.int32), axis=0)  # a chosen node's tree index: 1 + the chosen before it in the pool
    # pool index -> tree index (0: not chosen, and the sink) and tree index -> pool index, through memory: the
    # ancestor walk below reads them at pool indices that other threads hold
    tl.store(tree_of_ptr + b * (P + 1) + j, tl.where(chosen, t, 0), mask=j <= P)
    tl.store(pool_of_ptr + b * N + t, j, mask=chosen)
    tl.debug_barrier()
    n = tl.arange(0, N_BLOCK)  # the tree's nodes
    nok = n < N
    node = tl.load(pool_of_ptr + b * N + n, mask=nok & (n > 0), other=P)  # the root: the sink
    best_row = best_ptr + b * best_stride
    tree_of = tree_of_ptr + b * (P + 1)
    tok = tl.load(tok_ptr + b * P + node, mask=nok & (n > 0), other=0)
    tl.store(tok_out_ptr + b * N + n, tl.where(n == 0, tl.load(root_ptr + b), tok), mask=nok)
    x = _pool_parent(node, best_row, P, K)
    tl.store(par_out_ptr + b * N + n, tl.load(tree_of + x, mask=nok, other=0), mask=nok)
    m = tl.arange(0, N_BLOCK)
    anc = n[:, None] == m[None, :]
    for _ in tl.static_range(LEVELS):  # up the pool's parents to the sink (tree index 0, the root)
        anc |= tl.load(tree_of + x, mask=nok, other=0)[:, None] == m[None, :]
        x = _pool_parent(x, best_row, P, K)
    anc = anc & nok[:, None] & (m[None, :] < N)
    tl.store(depth_out_ptr + b * N + n, tl.sum(anc.to(tl.int32), axis=1) - 1, mask=nok)
    tl.store(anc_out_ptr + (b * N + n[:, None]) * N + m[None, :], anc.to(tl.uint8),
             mask=nok[:, None] & (m[None, :] < N))


def tree_select(root, tok, score, best, penalty, k, N):
    """layers.tree_select in one launch: a program per request ranks its pool and walks its chosen nodes' parents."""
    import torch

    B, P = tok.shape
    dev = tok.device
    tok, score = tok.contiguous(), score.contiguous()
    best = tok if best is None else best.contiguous()  # (depth 1: no expansion's inputs are read)
    tree_of = torch.empty(B, P + 1, dtype=torch.int32, device=dev)  # the kernel's scratch
    pool_of = torch.empty(B, N, dtype=torch.int32, device=dev)
    tokens, parent, depth = (torch.empty(B, N, dtype=torch.long, device=dev) for _ in range(3))
    anc = torch.empty(B, N, N, dtype=torch.bool, device=dev)
    _tree_select_kernel[(B,)](root, tok, score, best, penalty, tree_of, pool_of, tokens, parent, depth,
                              anc.view(torch.uint8), P, best.stride(0), K=k, N=N, LEVELS=(P - k) // (k * k) + 1,
                              P_BLOCK=triton.next_power_of_2(P + 1), N_TOP=triton.next_power_of_2(N - 1),
                              N_BLOCK=triton.next_power_of_2(N),
                              num_warps=8)
    return tokens, parent, depth, anc


@triton.jit
def _tree_accept_kernel(tok_ptr, par_ptr, depth_ptr, anc_ptr, choice_ptr, path_ptr, k_ptr, emit_ptr, N, P,
                        N_BLOCK: tl.constexpr, P_BLOCK: tl.constexpr):
    b = tl.program_id(0)  # one request's tree
    n = tl.arange(0, N_BLOCK)  # its nodes (rows of anc), and its columns
    nok = n < N
    row = b.to(tl.int64) * N
    tok = tl.load(tok_ptr + row + n, mask=nok, other=0)
    par = tl.load(par_ptr + row + n, mask=nok, other=0)
    dep = tl.load(depth_ptr + row + n, mask=nok, other=0)
    # a node is right where the target's choice after its parent is its token (the root always)
    ok = (tok == tl.load(choice_ptr + row + par, mask=nok, other=-1)) | (dep == 0)
    a = tl.load(anc_ptr + (row + n[:, None]) * N + n[None, :], mask=nok[:, None] & nok[None, :], other=0) != 0
    # a node is accepted when it and every ancestor are right: no ancestor column that is wrong
    wrong = a & (ok == 0)[None, :]
    path_ok = (tl.max(wrong.to(tl.int32), axis=1) == 0) & nok
    key = tl.where(path_ok, dep, -1)
    k = tl.max(key, axis=0)
    leaf = tl.min(tl.where(key == k, n, N_BLOCK), axis=0)  # the deepest accepted node, the first of equals
    on = tl.load(anc_ptr + (row + leaf) * N + n, mask=nok, other=0) != 0  # the leaf's ancestors (itself too)
    lv = tl.arange(0, P_BLOCK)
    at = tl.min(tl.where(on[None, :] & (dep[None, :] == lv[:, None]), n[None, :], N_BLOCK), axis=1)
    path = tl.where(at < N_BLOCK, at, leaf)  # past the leaf's depth: the leaf again
    pok = lv < P
    tl.store(path_ptr + b * P + lv, path, mask=pok)
    tl.store(k_ptr + b, k)
    tl.store(emit_ptr + b * P + lv, tl.load(choice_ptr + row + path, mask=pok, other=0), mask=pok)


def tree_accept(tokens, parent, depth, anc, choice, max_path):
    """layers.tree_accept in one launch: a program per request."""
    import torch

    B, N = tokens.shape
    tokens, parent, depth, choice = (x.contiguous() for x in (tokens, parent, depth, choice))
    path, emitted = (torch.empty(B, max_path, dtype=torch.long, device=tokens.device) for _ in range(2))
    k = torch.empty(B, dtype=torch.long, device=tokens.device)
    _tree_accept_kernel[(B,)](tokens, parent, depth, anc.contiguous().view(torch.uint8), choice, path, k, emitted,
                              N, max_path, N_BLOCK=triton.next_power_of_2(N),
                              P_BLOCK=triton.next_power_of_2(max_path), num_warps=4)
    return path, k, emitted


@triton.jit
def _act(g, GELU: tl.constexpr):
    """act(g) in float32: SiLU, or GELU's tanh approximation (tanh(z) = 2 sigmoid(2z) - 1)."""
    if GELU:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))
    else:
        a = g * tl.sigmoid(g)
    return a


@triton.jit
def _act_mul_kernel(gu_ptr, out_ptr, n_cols, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0)
    dtype = g.dtype
    a = _act(g.to(tl.float32), GELU)
    tl.store(out_ptr + row * n_cols + cols, (a.to(dtype).to(tl.float32) * u.to(tl.float32)).to(dtype), mask=ok)


def act_mul(gate_up, gelu):
    import torch

    T, I2 = gate_up.shape
    assert gate_up.is_contiguous()
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _act_mul_kernel[(T, triton.cdiv(I2 // 2, BLOCK))](gate_up, out, I2 // 2, GELU=gelu, BLOCK=BLOCK, num_warps=4)
    return out


# attention's key loop, shared by _attn_kernel (a Span: decode, tree, draft rows; KV splits) and _varlen_kernel (a
# packed causal pass): a key block's scores, then one online-softmax step; each kernel builds only its own mask
@triton.jit
def _key_block(q, kbase, bt_row, s0, stop, dims, stride_ks, scale, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
               IEEE: tl.constexpr):
    """Logical key slots cols = s0 .. s0 + BLOCK_N - 1 of one sequence (col_ok: < stop), their physical slots in
    the paged pool (phys = bt_row[s // PAGE] * PAGE + s % PAGE, bt_row its block-table row) and the scores
    q k^T * scale [BLOCK_M, BLOCK_N] -> (cols, col_ok, phys, qk). IEEE (fp32): exact products, not TF32."""
    cols = s0 + tl.arange(0, BLOCK_N)
    col_ok = cols < stop
    page = tl.load(bt_row + cols // PAGE, mask=col_ok, other=0)
    phys = page * PAGE + cols % PAGE
    k = tl.load(kbase + phys[:, None] * stride_ks + dims[None, :], mask=col_ok[:, None], other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else None) * scale
    return cols, col_ok, phys, qk


@triton.jit
def _softmax_step(qk, vis, m_i, l_i, acc, vbase, phys, col_ok, dims, stride_ks, IEEE: tl.constexpr):
    """Flash attention's online softmax over one key block: the scores qk masked to vis, the running max m_i and
    sum l_i and the unnormalised output acc [BLOCK_M, D] (fp32) rescaled to the new max, the block's values (rows
    phys of the pool) added -> (m_i, l_i, acc)."""
    qk = tl.where(vis, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: p = alpha = 0, not NaN
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(vbase + phys[:, None] * stride_ks + dims[None, :], mask=col_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else None)
    return m_new, l_i, acc


# the per-pass ints (rows, spans, splits, the strides of per-pass tensors) are not specialised: Triton compiles a
# variant per (== 1, % 16) pattern of each specialised int, and under continuous joins new patterns keep appearing
@triton.jit(do_not_specialize=["T", "m", "stride_new_b", "stride_new", "stride_qpos", "stride_bt", "S", "n_splits"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, new_ptr, qpos_ptr, kpos_ptr, n_ptr, bt_ptr, o_ptr, part_o_ptr, part_ml_ptr,
                 cnt_ptr, T, H, m, stride_new_b, stride_new, stride_qpos, stride_bt, S, n_splits, stride_kh,
                 stride_ks, window, scale, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr,
                 ONE_LAUNCH: tl.constexpr, IEEE: tl.constexpr):
    """One program: BLOCK_M rows (token t, q head kvh*G + g) of request b and one kv head over one split of the
    logical key slots those rows see (the splits divide the request's own span, not the graph's bound S, so no
    program idles on slots past it). Keys visible to row t: slots < n[b], and new slot n[b] + j where new[b, t, j]; within
    `window` positions if set. Logical slot s is read at physical slot table[b, s // PAGE] * PAGE + s % PAGE.
    SPLIT: the programs of one (rows, kv head, request) write unnormalised partials; ONE_LAUNCH: the last of them
    to finish (its counter in cnt_ptr, an acq_rel atomic, as the skinny GEMM's splits) merges them as
    _combine_kernel does and resets the counter, so a split attention is one launch; else _combine_kernel merges."""
    pid_m, kvh, pid_bs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, split = pid_bs // n_splits, pid_bs % n_splits
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t, g = t // G, t % G
    head = kvh * G + g
    row_ok = t < T
    r = b * T + t  # the row in the batch
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + (r * H + head)[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    n = tl.load(n_ptr + b)
    t_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, T * G - 1) // G
    # a row sees no new slot after its own (column m - T + t): later slots are skipped, not just masked
    end = tl.minimum(n + m - T + t_last + 1, S)
    split_len = tl.cdiv(tl.cdiv(end, n_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    stop = tl.minimum(start + split_len, end)
    if WINDOW:
        qpos = tl.load(qpos_ptr + r * stride_qpos, mask=row_ok, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kbase = k_ptr + kvh * stride_kh
    vbase = v_ptr + kvh * stride_kh
    bt_row = bt_ptr + b * stride_bt
    new_row = new_ptr + b * stride_new_b + t[:, None] * stride_new
    for s0 in range(start, stop, BLOCK_N):
        cols, col_ok, phys, qk = _key_block(q, kbase, bt_row, s0, stop, dims, stride_ks, scale, BLOCK_N, PAGE, IEEE)
        j = cols - n
        is_new = (j >= 0) & col_ok
        flag = tl.load(new_row + j[None, :], mask=row_ok[:, None] & is_new[None, :], other=0)
        vis = ((cols < n)[None, :] | (flag != 0)) & col_ok[None, :] & row_ok[:, None]
        if WINDOW:
            kpos = tl.load(kpos_ptr + phys, mask=col_ok, other=0)
            vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
        m_i, l_i, acc = _softmax_step(qk, vis, m_i, l_i, acc, vbase, phys, col_ok, dims, stride_ks, IEEE)
    out = (r * H + head)[:, None] * D + dims[None, :]
    rows_all = tl.num_programs(2) // n_splits * T  # B * T
    if SPLIT:  # unnormalised partials; the combine kernel (or the last split: ONE_LAUNCH) merges the splits
        tl.store(part_o_ptr + split * rows_all * H * D + out, acc, mask=row_ok[:, None])
        ml = (split * rows_all * H + r * H + head) * 2
        tl.store(part_ml_ptr + ml, m_i, mask=row_ok)
        tl.store(part_ml_ptr + ml + 1, l_i, mask=row_ok)
        if ONE_LAUNCH:
            tl.debug_barrier()  # every thread's partials written before the count says so
            group = (b * tl.num_programs(1) + kvh) * tl.num_programs(0) + pid_m
            if tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel") == n_splits - 1:
                tl.debug_barrier()
                mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
                for s in range(0, n_splits):
                    at = (s * rows_all * H + r * H + head) * 2
                    mx = tl.maximum(mx, tl.load(part_ml_ptr + at, mask=row_ok, other=float("-inf"),
                                                cache_modifier=".cg"))
                acc = tl.zeros([BLOCK_M, D], tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                for s in range(0, n_splits):
                    at = (s * rows_all * H + r * H + head) * 2
                    ms = tl.load(part_ml_ptr + at, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    ls = tl.load(part_ml_ptr + at + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
                    wgt = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - mx))  # an empty split weighs 0
                    o_s = tl.load(part_o_ptr + s * rows_all * H * D + out, mask=row_ok[:, None], other=0.0,
                                  cache_modifier=".cg")
                    acc += o_s * wgt[:, None]
                    l_i += ls * wgt
                tl.store(o_ptr + out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.atomic_xchg(cnt_ptr + group, 0)
    else:
        tl.store(o_ptr + out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["TH", "n_splits"])  # per-pass ints, as _attn_kernel's
def _combine_kernel(part_o_ptr, part_ml_ptr, o_ptr, TH, n_splits, NSPLIT: tl.constexpr, D: tl.constexpr):
    r = tl.program_id(0)  # one (token, head) row
    splits = tl.arange(0, NSPLIT)
    ok = splits < n_splits
    ms = tl.load(part_ml_ptr + (splits * TH + r) * 2, mask=ok, other=float("-inf"))
    ls = tl.load(part_ml_ptr + (splits * TH + r) * 2 + 1, mask=ok, other=0.0)
    mx = tl.max(ms, axis=0)
    wgt = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - mx))  # an empty split (past the span) weighs 0
    dims = tl.arange(0, D)
    o = tl.load(part_o_ptr + (splits[:, None] * TH + r) * D + dims[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(o * wgt[:, None], axis=0) / tl.sum(ls * wgt, axis=0)
    tl.store(o_ptr + r * D + dims, o.to(o_ptr.dtype.element_ty))


def attention_plan(T: int, G: int, KV: int, S: int, D: int, sms: int = 132, B: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, n_splits, num_warps) for B requests of T rows: enough programs to fill the GPU when the
    rows are few (decode, draft steps), one split when the rows alone fill it (prefill, big batches). Static in
    (B, T, S): capturable."""
    # 16 x 32 tiles and ~3 programs an SM won every shape of bench-kernels --attention on the H200 (decode, a draft
    # step, a 60-token tree, 8 trees, 64 decodes: 0.50-0.90x the time of 64-row tiles filling one wave): the work
    # is latency-bound (a few hundred KB of KV), so more, smaller programs keep more loads in flight
    block_m, block_n = 16, 32
    programs = triton.cdiv(T * G, block_m) * KV * B
    return block_m, block_n, max(1, min(triton.cdiv(S, block_n), 3 * sms // programs)), 4


# the plans layers.attention_choice measures against attention_plan's for a decode step of many requests
DECODE_PLANS = ((16, 64, 1, 4), (16, 128, 1, 4), (16, 128, 1, 8), (16, 64, 2, 4), (16, 32, 2, 4))


def attention_candidates(T: int, G: int, KV: int, S: int, D: int, B: int) -> list[tuple]:
    """The other plans worth timing against attention_plan's for B requests of T rows (layers.attention_choice):
    - where attention_plan splits the keys (decode and draft steps, trees, few requests): the same plan in one
      launch, its last split merging the partials (ONE_LAUNCH) instead of a second, combine, launch (one launch
      and its gap fewer per layer: 28 of a decode step's ~265 on qwen2.5-coder-1.5b);
    - where it is one program per (request, kv head) over the whole span (T = 1 and programs enough to fill the
      GPU, so no split): its 32-key loop is S / 32 dependent steps, each waiting on a block-table load, then a key
      load. At 256 requests x ~600 slots on an H100 that loop took 2.15 ms of a 4.52-ms decode step, where the
      KV's bytes take ~1.4 ms (benchmarks/h100_timeline_ar256_trace_34ef01f_qwen1.5b.md). The candidates: wider
      key blocks (fewer steps, more bytes a load), more warps, two splits (twice the programs, half the steps each;
      merged by a combine launch or in one launch).
    A plan is (BLOCK_M, BLOCK_N, splits, warps[, one launch])."""
    default = attention_plan(T, G, KV, S, D, B=B)
    if default[2] > 1:
        return [(*default, True)]
    if T != 1:
        return []
    plans = [(default[0], *p[1:]) for p in DECODE_PLANS if (default[0], *p[1:]) != default]
    return plans + [(*p, True) for p in plans if p[2] > 1]


def attention(q, k_cache, v_cache, span, q_pos, k_pos, window, scale, plan=None):
    """plan: attention_plan's tuple, to override it (bench-kernels --attention sweeps it; layers.attention_choice
    picks a measured one of attention_candidates'); a fifth element True: a split plan in one launch."""
    import torch

    from .layers import KV_BLOCK

    R, H, D = q.shape
    KV = k_cache.shape[0]
    G = H // KV
    new, table = span.new, span.block_table
    B, T, m = new.shape
    assert R == B * T and q.is_contiguous() and new.stride(2) == 1 and k_cache.stride(-1) == 1
    assert k_pos.stride(0) == 1 and table.stride(1) == 1 and span.n.stride(0) == 1
    block_m, block_n, n_splits, warps, *one = plan or attention_plan(T, G, KV, span.S, D, B=B)
    o = torch.empty_like(q)
    split = n_splits > 1
    grid = (triton.cdiv(T * G, block_m), KV, B * n_splits)
    cnt = _counters(q.device) if split and one and one[0] and grid[0] * KV * B <= COUNTERS else None
    if split:
        part_o = torch.empty(n_splits, R, H, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(n_splits, R, H, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = o
    _attn_kernel[grid](q, k_cache, v_cache, new.view(torch.uint8), q_pos, k_pos, span.n, table, o, part_o, part_ml,
                       o if cnt is None else cnt, T, H, m, new.stride(0), new.stride(1), q_pos.stride(0),
                       table.stride(0), span.S, n_splits, k_cache.stride(0), k_cache.stride(1), window, scale,
                       G=G, D=D, PAGE=KV_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, WINDOW=window > 0,
                       ONE_LAUNCH=cnt is not None, IEEE=q.dtype == torch.float32, num_warps=warps)
    if split and cnt is None:
        _combine_kernel[(R * H,)](part_o, part_ml, o, R * H, n_splits, NSPLIT=triton.next_power_of_2(n_splits), D=D,
                                  num_warps=1)
    return o


# --- packed causal attention: a batched step's prompt chunks and decode rows (layers.Spans, causal) in one launch ---
# Launching _attn_kernel per part costs the host more than the GPU's work in a step with many chunks (28 layers x
# ~16 parts x the reference's ~10 ops of a long chunk). Here every part is causal over its own rows, so a
# sequence (one chunk, or one decode request) is just (first row, rows T, committed n, block-table row): row t
# sees logical slots < n + t + 1. The grid runs over a flat list of (sequence, row block) tiles, built on the
# host once per pass and kept on the Spans (every layer reuses it). No KV splits: the rows of such a pass fill
# the GPU (and a lone decode row's split is what the graphs' single Span does).


@triton.jit(do_not_specialize=["stride_qpos", "stride_bt"])  # per-pass ints, as _attn_kernel's
def _varlen_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, n_ptr, bt_ptr, tiles_ptr, seqs_ptr, o_ptr, H,
                   stride_qpos, stride_bt, stride_kh, stride_ks, window, scale, G: tl.constexpr, D: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                   IEEE: tl.constexpr):
    """One program: row block `blk` (BLOCK_M rows of (token t, q head kvh*G + g)) of sequence `seq` and one kv
    head. seqs[seq] = (first row in the pass, rows T); n[seq] committed slots; row t sees logical slots
    < n + t + 1 (within `window` positions if set), read at physical table[seq, s // PAGE] * PAGE + s % PAGE."""
    tile, kvh = tl.program_id(0), tl.program_id(1)
    seq, blk = tl.load(tiles_ptr + 2 * tile), tl.load(tiles_ptr + 2 * tile + 1)
    row0, T = tl.load(seqs_ptr + 2 * seq), tl.load(seqs_ptr + 2 * seq + 1)
    n = tl.load(n_ptr + seq)
    i = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    t, g = i // G, i % G
    head = kvh * G + g
    row_ok = t < T
    r = row0 + t  # the row in the pass
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + (r * H + head)[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    t_last = tl.minimum(blk * BLOCK_M + BLOCK_M - 1, T * G - 1) // G
    end = n + t_last + 1  # the block's last row sees no slot after its own: later ones are skipped
    if WINDOW:
        qpos = tl.load(qpos_ptr + r * stride_qpos, mask=row_ok, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kbase = k_ptr + kvh * stride_kh
    vbase = v_ptr + kvh * stride_kh
    bt_row = bt_ptr + seq * stride_bt
    for s0 in range(0, end, BLOCK_N):
        cols, col_ok, phys, qk = _key_block(q, kbase, bt_row, s0, end, dims, stride_ks, scale, BLOCK_N, PAGE, IEEE)
        vis = (cols[None, :] < (n + t + 1)[:, None]) & row_ok[:, None]  # causal (implies cols < end)
        if WINDOW:
            kpos = tl.load(kpos_ptr + phys, mask=col_ok, other=0)
            vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
        m_i, l_i, acc = _softmax_step(qk, vis, m_i, l_i, acc, vbase, phys, col_ok, dims, stride_ks, IEEE)
    out = (r * H + head)[:, None] * D + dims[None, :]
    tl.store(o_ptr + out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def varlen_plan(rows: int, D: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a packed pass whose longest sequence has `rows` (token, head) rows per kv head (as
    attention_plan picks for one span of that many rows)."""
    return (16 if rows <= 16 else 32 if rows <= 32 else 64), (64 if D <= 128 else 32)


def varlen_tiles(spans, G: int, block_m: int):
    """The tile list and per-sequence metadata of a causal Spans for BLOCK_M rows of G heads a tile, on the
    device: (tiles [N, 2] int32 (sequence, row block), seqs [nseq, 2] int32 (first row, rows), n [nseq],
    table [nseq, blocks]). Built once per (G, BLOCK_M) and kept on the Spans: each layer of the pass (of the
    target and a draft sharing the rows) reuses it. The host part goes to the device in one copy, from pinned
    memory without a wait (mid-forward: the GPU still has the earlier layers' work queued)."""
    import torch

    key = (G, block_m)
    if key not in spans._varlen:
        if "seqs" not in spans._varlen:  # the parts' device tensors, one cat each (same width in the runner)
            width = max(p.block_table.shape[1] for p in spans.parts)
            table = torch.cat([torch.nn.functional.pad(p.block_table, (0, width - p.block_table.shape[1]))
                               for p in spans.parts])
            spans._varlen["seqs"] = (torch.cat([p.n for p in spans.parts]), table)
        seqs, tiles = spans.layout(G, block_m)
        host = torch.tensor([*seqs, *tiles], dtype=torch.int32)
        n, table = spans._varlen["seqs"]
        if n.is_cuda:
            host = host.pin_memory().to(n.device, non_blocking=True)
        spans._varlen[key] = (host[len(seqs):], host[:len(seqs)], n, table)
    return spans._varlen[key]


def attention_varlen(q, k_cache, v_cache, spans, q_pos, k_pos, window, scale):
    """layers.attention over a causal Spans (every part's rows causal over their own new slots): one launch."""
    import torch

    from .layers import KV_BLOCK

    R, H, D = q.shape
    KV = k_cache.shape[0]
    G = H // KV
    assert R == sum(spans.rows) and q.is_contiguous() and k_cache.stride(-1) == 1 and k_pos.stride(0) == 1
    block_m, block_n = varlen_plan(max(p.new.shape[1] for p in spans.parts) * G, D)
    block_m = spans.block_m or block_m
    tiles, seqs, n, table = varlen_tiles(spans, G, block_m)
    assert table.stride(1) == 1 and n.stride(0) == 1
    o = torch.empty_like(q)
    _varlen_kernel[(tiles.shape[0], KV)](q, k_cache, v_cache, q_pos, k_pos, n, table, tiles, seqs, o, H,
                                         q_pos.stride(0), table.stride(0), k_cache.stride(0), k_cache.stride(1),
                                         window, scale, G=G, D=D, PAGE=KV_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n,
                                         WINDOW=window > 0, IEEE=q.dtype == torch.float32, num_warps=4)
    return o


# --- skinny GEMM: out [M, N] = x [M, K] @ w [N, K]^T (+ bias) for M <= SKINNY_ROWS (decode, draft, verify) ---
# At these row counts a projection only streams its weight; cuBLAS often launches too few blocks to keep enough
# bytes in flight (qkv at 16% of bandwidth on the H200). Here each program owns BLOCK_N weight rows and one split
# of K, so the grid is cdiv(N, BLOCK_N) x splits programs and every weight byte is read once; with splits > 1
# each program writes fp32 partials and counts itself done on its column block's counter (an acq_rel atomic);
# the last one to finish sums the partials in split order (deterministic, whichever program that is) and sets
# the counter back to 0, so a split GEMM is one launch, with no memset, and stays capturable (the counters are
# shared by launches of one shape: launches on one stream at a time, as every caller makes them). ACT folds the
# gated activation into the prologue: x is then gate | up [M, 2K] and the program multiplies act(gate) * up
# (rounded as act_mul rounds) while loading, so the down projection needs no separate activation launch. NORM
# folds the residual add + RMSNorm in: x is the residual, the program adds delta (rounded), writes the sum (first
# column block only), weights it by the norm's (offset + w) and sums the rows' squares; 1 / rms scales the output
# at the end (after the split sum when K is split: a row's norm needs all of K), so nothing waits for a separate
# norm launch. It differs from add_rms_norm + GEMM only in rounding: the
# normed row is not rounded before the 1 / rms scale. ROPE (with NORM, q|k|v only) folds rope_cache_write into
# the epilogue: a column block is BLOCK_N / 2 columns of one head's first half and their partners of its second
# half, so the program (the last split's) rounds the sums as the q|k|v output is rounded, rotates q and k heads,
# and writes q out and k, v into the cache slots; the q|k|v output itself is never written. layers.linear /
# layers.norm_linear pick a config (or the unfused path) per shape by measurement.


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, d_ptr, nw_ptr, res_ptr, sq_ptr, cnt_ptr,
                   cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, M, N, K, k_split, n_splits, stride_xm,
                   eps, offset, H, KV, stride_pos, stride_slot, stride_kh, stride_ks,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GELU: tl.constexpr, SPLIT: tl.constexpr,
                   NORM: tl.constexpr, HAS_DELTA: tl.constexpr, ROPE: tl.constexpr, HEAD_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    if ROPE:  # a column block holds BLOCK_N / 2 columns of one head's first half and the matching ones of its
        # second half (the rotation's pairs), so the epilogue can rotate them
        head = pid_n // (HEAD_D // BLOCK_N)
        j0 = (pid_n % (HEAD_D // BLOCK_N)) * (BLOCK_N // 2)
        i = tl.arange(0, BLOCK_N)
        rn = head * HEAD_D + j0 + i % (BLOCK_N // 2) + (i >= BLOCK_N // 2).to(tl.int32) * (HEAD_D // 2)
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sq = tl.zeros([BLOCK_M], tl.float32)  # NORM: the rows' sum of squares over this K range
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x_off = rm[:, None] * stride_xm + kk[None, :]
        x_ok = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + x_off, mask=x_ok, other=0.0)
        if ACT:  # x is the gate; up sits K columns further
            u = tl.load(x_ptr + x_off + K, mask=x_ok, other=0.0)
            a = _act(x.to(tl.float32), GELU).to(x.dtype).to(tl.float32)
            x = (a * u.to(tl.float32)).to(u.dtype)
        if NORM:  # x is the residual: add delta (rounded, as add_rms_norm), write the sum once (the first
            # column block), weight by the norm's (offset + w); the rows' 1 / rms scales the sums at the end
            if HAS_DELTA:
                dl = tl.load(d_ptr + x_off, mask=x_ok, other=0.0)
                x = (x.to(tl.float32) + dl.to(tl.float32)).to(dl.dtype)
                tl.store(res_ptr + x_off, x, mask=x_ok & (pid_n == 0))
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
            nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = (xf * (offset + nw)[None, :]).to(x.dtype)
        if IEEE:  # fp32, or the interpreter (its dot mishandles bf16): exact products, fp32 sums
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = rm[:, None] * N + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    last = True
    if SPLIT:  # fp32 partials; the last split of this column block to finish sums them all, in split order (the
        # same sum every run), and resets the block's counter for the next launch: no second launch, no memset
        tl.store(part_ptr + pid_k * M * N + out, acc, mask=ok)
        sq_at = sq_ptr + pid_n * M + rm  # [splits, column blocks, M]: every block's reducer reads its own
        if NORM:
            tl.store(sq_at + pid_k * tl.num_programs(0) * M, sq, mask=m_ok)
        tl.debug_barrier()  # every thread's partials written before the count says so
        last = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == n_splits - 1
        if last:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            sq = tl.zeros([BLOCK_M], tl.float32)
            for s in range(0, n_splits):
                acc += tl.load(part_ptr + s * M * N + out, mask=ok, other=0.0, cache_modifier=".cg")
                if NORM:
                    sq += tl.load(sq_at + s * tl.num_programs(0) * M, mask=m_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    if last:
        if NORM:
            acc = acc * tl.rsqrt(sq / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ROPE:  # rotate q and k (rounded first, as the q|k|v output is), write q out and k, v into the cache
            dtype = q_ptr.dtype.element_ty
            pairs = tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1))
            x1, x2 = tl.split(pairs)  # [BLOCK_M, BLOCK_N / 2]: first-half columns, their second-half partners
            half = j0 + tl.arange(0, BLOCK_N // 2)
            pos = tl.load(pos_ptr + rm * stride_pos, mask=m_ok, other=0)
            c = tl.load(cos_ptr + pos[:, None] * (HEAD_D // 2) + half[None, :], mask=m_ok[:, None], other=0.0)
            sn = tl.load(sin_ptr + pos[:, None] * (HEAD_D // 2) + half[None, :], mask=m_ok[:, None], other=0.0)
            is_v = head >= H + KV
            y1 = tl.where(is_v, x1, x1 * c - x2 * sn).to(dtype)
            y2 = tl.where(is_v, x2, x2 * c + x1 * sn).to(dtype)
            slot = tl.load(slot_ptr + rm * stride_slot, mask=m_ok, other=0)
            kvh = tl.where(is_v, head - H - KV, head - H)
            cache = kvh * stride_kh + slot[:, None] * stride_ks + half[None, :]
            q_at = q_ptr + (rm[:, None] * H + head) * HEAD_D + half[None, :]
            row_ok = m_ok[:, None]
            q_ok, k_ok, v_ok = row_ok & (head < H), row_ok & (head >= H) & (head < H + KV), row_ok & is_v
            tl.store(q_at, y1, mask=q_ok)
            tl.store(q_at + HEAD_D // 2, y2, mask=q_ok)
            tl.store(k_ptr + cache, y1, mask=k_ok)
            tl.store(k_ptr + cache + HEAD_D // 2, y2, mask=k_ok)
            tl.store(v_ptr + cache, y1, mask=v_ok)
            tl.store(v_ptr + cache + HEAD_D // 2, y2, mask=v_ok)
        else:
            tl.store(out_ptr + out, acc.to(out_ptr.dtype.element_ty), mask=ok)


def skinny_configs(M: int, N: int, K: int, fp32: bool, sms: int = 132) -> list[tuple[int, int, int]]:
    """The candidates layers.linear measures for one shape: (BLOCK_N, BLOCK_K, splits). Narrow and wide weight
    tiles, each unsplit and split so that the grid has ~4 programs per SM (each split at least 2 K steps)."""
    out = []
    for block_n in (16, 64):  # shared memory: stages x (w + x (+ up)) tiles stays under ~150 KB on every pick
        block_k = 64 if fp32 else 256 if M <= 16 and block_n == 16 else 128
        tiles, steps = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
        splits = max(1, min(triton.cdiv(4 * sms, tiles), steps // 2))
        splits = triton.cdiv(steps, triton.cdiv(steps, splits))  # no empty split
        out += [(block_n, block_k, 1)] + ([(block_n, block_k, splits)] if splits > 1 else [])
    return out


def skinny_linear(x, w, bias, act, config):
    """x [M, K] (act: gate | up [M, 2K], act 'silu' or 'gelu') @ w [N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    assert x.stride(1) == 1 and x.shape[1] == (2 * w.shape[1] if act else w.shape[1])
    return _skinny(x, w, bias, act, config)


def skinny_norm_linear(res, delta, norm_w, eps, offset, w, bias, config, rope=None):
    """RMSNorm(res + delta) by norm_w (scaled by offset + w, as add_rms_norm) @ w^T (+ bias) in one launch ->
    (res + delta, out); delta None: (res, RMSNorm(res) @ w^T). rope (heads, kv_heads, (cos, sin), positions,
    slots, k_cache, v_cache): w is q|k|v and the launch also does rope_cache_write's work (without Gemma's q/k
    norms): out is then the rotated q [M, heads, D], k and v written into the cache."""
    import torch

    assert res.is_contiguous() and (delta is None or delta.is_contiguous()) and res.shape[1] == w.shape[1]
    new_res = torch.empty_like(res) if delta is not None else res
    return new_res, _skinny(res, w, bias, None, config, (delta, norm_w, eps, offset, new_res), rope)


def rope_fits(config, head_dim: int) -> bool:
    """Whether a config's column blocks tile the heads (the rotation's pairs in one program)."""
    return head_dim % config[0] == 0


_COUNTERS: dict = {}  # device -> the split launches' counters (the skinny GEMM's column blocks, a one-launch
# attention's (rows, kv head, request) groups), int32 zeros; every launch
COUNTERS = 1 << 16  # leaves them 0), kept for good: captured CUDA graphs hold their address


def _counters(device):
    """The device's counters; None while a CUDA graph is being captured and they do not exist yet (allocated
    there, their zeroing would only run at the graph's replays: the launch then runs unsplit instead)."""
    import torch

    cnt = _COUNTERS.get(device)
    if cnt is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        cnt = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return cnt


def _skinny(x, w, bias, act, config, norm=None, rope=None):
    import torch

    from .layers import SKINNY_ROWS

    M = x.shape[0]
    N, K = w.shape
    block_n, block_k, splits = config
    assert M <= SKINNY_ROWS and w.is_contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(N, block_n)
    cnt = _counters(x.device) if splits > 1 and tiles <= COUNTERS else None
    if cnt is None:
        splits, cnt = 1, out
    k_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_split)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    b = bias if bias is not None else w
    delta, norm_w, eps, offset, new_res = norm if norm is not None else (None, w, 0.0, 0.0, out)
    sq = torch.empty(splits, tiles, M, dtype=torch.float32, device=x.device) if norm is not None and splits > 1 \
        else part
    ieee = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    if rope is not None:
        heads, kv_heads, (cos, sin), positions, slots, k_cache, v_cache = rope
        D = k_cache.shape[-1]
        assert N == (heads + 2 * kv_heads) * D and rope_fits(config, D) and k_cache.stride() == v_cache.stride()
        assert k_cache.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        q = torch.empty(M, heads, D, dtype=x.dtype, device=x.device)
        rope_args = (cos, sin, positions, slots, q, k_cache, v_cache)
        rope_ints = (heads, kv_heads, positions.stride(0), slots.stride(0), k_cache.stride(0), k_cache.stride(1))
    else:
        D, q, rope_args, rope_ints = 16, out, (out,) * 7, (0,) * 6
    _skinny_kernel[(tiles, splits)](
        x, w, b, out, part, delta if delta is not None else x, norm_w, new_res, sq, cnt, *rope_args, M, N, K,
        k_split, splits, x.stride(0), eps, offset, *rope_ints, HAS_BIAS=bias is not None, ACT=act is not None,
        GELU=act == "gelu", SPLIT=splits > 1, NORM=norm is not None, HAS_DELTA=delta is not None,
        ROPE=rope is not None, HEAD_D=D, BLOCK_M=16 if M <= 16 else 32 if M <= 32 else 64, BLOCK_N=block_n,
        BLOCK_K=block_k, IEEE=ieee, num_warps=4, num_stages=3 if x.dtype == torch.float32 or M > 16 else 4)
    return q if rope is not None else out
