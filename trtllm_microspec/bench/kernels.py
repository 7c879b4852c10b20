"""`microspec bench-kernels`: MicroSpec's kernels and one whole draft step on the GPU, at four LM-head shapes.

Every figure is the median over --iters of one CUDA-graph replay timed with CUDA events, with the L2 cache
flushed before each replay (in a real round the target model evicts everything in between). Rows:
  head full / static 32k / packed 3k   ops.packed_head over V, 32,768 or W_max + 2 rows: GEMM + masked
                                       log-softmax + top-k + slot -> id. "torch epilogue" is the reference op
                                       on the same buffer (A/B of the fused epilogue), "GEMM only" is F.linear.
  gather delta / refill                ops.gather_rows of one step's newly active rows (the mean over a synthetic
                                       Zipf(1) stream, inside the window update's padded output of 2 x --step-ids
                                       rows), and of all W_max rows (a request's start)
  window update                        ops.window_update_rows of --step-ids ids from that stream (one window)
  head packed 3k, epilogue only        the fused masked log-softmax + top-k alone, on the packed head's logits
  tree grow / tree select              a round's tree bookkeeping at one request (layers.tree_grow, tree_select):
                                       the fused kernel and its torch reference
  step ...                             one draft step: the EAGLE backbone (fc + one decoder layer at the model's
                                       shape, random bf16 weights, 1024 cached positions) then the head:
                                       full, static 32k, static 3k (an already-packed buffer), microspec (update,
                                       the gather on a copy stream overlapping the backbone, head on the packed
                                       buffer), microspec without the gather, with the gather on the compute
                                       stream, and naive (the paper's "x Async": update + an indexed GEMM over
                                       head[id_of] each call, no packing)
Bandwidth = the bytes a kernel must move (weights read; a gather reads and writes each row) / its time, against
the rate a large device-to-device copy reaches on this GPU, measured (bytes read + written: 4.2 TB/s on the H200,
~3.0 on the H100). "launch" is the replay
of one empty kernel.

--layers instead: the decoder layer's kernels at the --shapes model shapes (default qwen2.5-1.5b) on random
weights, at each of --rows rows: every projection (q|k|v, O, gate|up, down with SiLU x up, EAGLE's fc, the LM head)
on cuBLAS, on each skinny-GEMM config and on the default path, with GB/s and % of the GPU's HBM peak; the
residual add + RMSNorm folded into q|k|v and gate|up vs unfused; one decoder layer with the fold off vs the
default, with its kernel count.
"""
from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.model import KVCache, ModelConfig, Span
from ..models.registry import UserError
from ..speculative.tree import causal

DEVICE = "cuda"
CONTEXT = 1024  # committed positions the draft layer attends to
STATIC_K = 32768
PINNED = [0, 1]  # stand-ins for the EOS ids every window pins
SHAPES = {  # the target model's LM head and the EAGLE layer of its shape
    "llama3-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_heads=32,
                      num_kv_heads=8, head_dim=128),
    "llama3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_heads=32,
                        num_kv_heads=8, head_dim=64),
    "qwen2-7b": dict(arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_heads=28,
                     num_kv_heads=4, head_dim=128, attention_bias=True),
    "qwen2.5-1.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_heads=12,
                         num_kv_heads=2, head_dim=128, attention_bias=True),
}
HBM_PEAK = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12}  # bytes/s, the data sheets' HBM peak, by device name
H200_COPY_BW = 4.2e12  # bytes/s, read + written, a large device-to-device copy on the H200


@functools.cache
def copy_bw() -> float:
    """Bytes/s, read + written, of a large device-to-device copy on this GPU (best of 5 copies of 1 GiB, measured
    once): the rate of the reports' byte floors (4.2e12 on the H200, ~3.0e12 on the H100 80GB HBM3). Off a GPU
    (the CPU tests of the reports) the H200's."""
    if not torch.cuda.is_available():
        return H200_COPY_BW
    x = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    y.copy_(x)
    best = math.inf
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return 2 * x.numel() / best


@functools.cache
def peak_bw() -> float:
    """Bytes/s, this GPU's HBM peak from its data sheet (HBM_PEAK), else its measured copy rate / 0.88 (the H200's
    ratio): the projection A/B's "% peak"."""
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_PEAK.items() if key in name), copy_bw() / 0.88)



class HeadEmbedding:
    """Stands in for the target whose embedding the draft borrows: the random head table embeds."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.table)


class Timer:
    def __init__(self, iters: int):
        self.iters = iters
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 5x the H200's L2

    def __call__(self, fn, feed=None) -> float:
        """Median microseconds of one replay of fn captured in a CUDA graph; feed(i) refreshes its inputs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: cuBLAS handles, lazy inits
            for i in range(2):
                feed and feed(i)
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters + 3)]
        for i, (a, b) in enumerate(events):
            feed and feed(i)
            self.flush.zero_()
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events[3:])


def weight_bytes(m) -> int:
    """The bytes of a module's parameters (the weights a pass over it reads at least once)."""
    return sum(p.numel() * p.element_size() for p in m.parameters())


def bench_shape(name: str, shape: dict, a, timer: Timer) -> list[dict]:
    from plugins import ops
    from plugins.check import STATE, alone, new_window

    from ..speculative.eagle import EagleDraft

    dev, bf16, K, W = DEVICE, torch.bfloat16, a.top_k, a.w_max
    cfg = ModelConfig(**shape, num_layers=1, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_seq_len=CONTEXT + 2 * max(a.rows), tie_word_embeddings=False)
    V, d = cfg.vocab_size, cfg.hidden_size
    g = torch.Generator(device=dev).manual_seed(0)
    head = torch.randn(V, d, generator=g, device=dev).mul_(0.02).to(bf16)
    with torch.device(dev):
        draft = EagleDraft(cfg, bias=False)
    draft.setup(HeadEmbedding(head), bf16, dev)
    dcache = KVCache(cfg, 1, bf16, dev)  # the draft layer's K and V: CONTEXT committed positions and the rows
    backbone_bytes = weight_bytes(draft)
    backbone_bytes += 2 * cfg.num_kv_heads * CONTEXT * cfg.head_dim * 2  # K and V of the context

    # the window, filled from a synthetic stream: ranks log-uniform over the vocabulary (Zipf, exponent 1)
    perm = torch.randperm(V, generator=g, device=dev)

    def zipf(n: int) -> torch.Tensor:
        rank = torch.exp(torch.rand(n, generator=g, device=dev) * math.log(V)).long().clamp(1, V) - 1
        return perm[rank]

    st = new_window(V, W, PINNED, dev)
    one = alone(dev)  # the window ops' batch: this one window

    def update(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, slots = ops.window_update_rows(*(st[k] for k in STATE), ids[None], one)
        return rows[0], slots[0]

    R = W + len(PINNED)
    packed_all = torch.zeros(R + 1, d, dtype=bf16, device=dev)
    packed, id_of = packed_all[:R], st["id_of"][0, :R]
    ops.gather_rows(head, torch.tensor(PINNED, device=dev), packed_all, torch.arange(len(PINNED), device=dev))
    rows, slots = update(zipf(4 * W))
    ops.gather_rows(head, rows, packed_all, slots)
    pool = torch.stack([zipf(a.step_ids) for _ in range(64)])
    fresh = torch.zeros((), dtype=torch.long, device=dev)
    for ids in pool:  # eagerly, once: how many rows a step really gathers
        rows, slots = update(ids)
        ops.gather_rows(head, rows, packed_all, slots)
        fresh += (slots < R).sum()
    delta = max(1, round(fresh.item() / len(pool)))
    step_ids = pool[0].clone()

    def feed(i: int) -> None:
        step_ids.copy_(pool[i % len(pool)])

    out = []

    def add(kernel: str, T, us: float, nbytes: float | None) -> None:
        out.append(dict(shape=name, rows=T, kernel=kernel, us=us, mb=nbytes and nbytes / 1e6,
                        tb_s=nbytes and nbytes / us / 1e6, pct_copy=nbytes and 100 * nbytes / us / 1e6 / (copy_bw() / 1e12),
                        floor_us=nbytes and nbytes / copy_bw() * 1e6))

    # per step, whatever the number of hidden rows: the gathers and the window update
    scratch = torch.empty(R + 1, d, dtype=bf16, device=dev)
    n2 = 2 * a.step_ids
    d_ids = torch.zeros(n2, dtype=torch.long, device=dev)
    d_slots = torch.full((n2,), R, dtype=torch.long, device=dev)
    where = torch.randperm(n2, generator=g, device=dev)[:delta]
    d_ids[where] = torch.randint(V, (delta,), generator=g, device=dev)
    d_slots[where] = torch.randperm(R, generator=g, device=dev)[:delta]
    add(f"gather delta ({delta} of {n2} rows)", "-", timer(lambda: ops.gather_rows(head, d_ids, scratch, d_slots)),
        2 * delta * d * 2)
    full_ids, full_slots = torch.randint(V, (W,), generator=g, device=dev), torch.arange(W, device=dev)
    add(f"gather refill ({W} rows)", "-", timer(lambda: ops.gather_rows(head, full_ids, scratch, full_slots)),
        2 * W * d * 2)
    add(f"window update ({a.step_ids} ids)", "-", timer(lambda: update(step_ids), feed), None)

    heads = {"full": (head, torch.arange(V, device=dev)),
             "static 32k": (head[:STATIC_K], torch.arange(STATIC_K, device=dev))}
    ids3 = torch.randperm(V, generator=g, device=dev)[:R]
    heads["packed 3k"] = (head.index_select(0, ids3), ids3)
    copy = torch.cuda.Stream()

    for T in a.rows:
        hidden = torch.randn(T, d, generator=g, device=dev).to(bf16)
        for kind, (buf, ids) in heads.items():
            add(f"head {kind}", T, timer(lambda: ops.packed_head(hidden, buf, ids, K)), buf.numel() * 2)
        buf, ids = heads["packed 3k"]
        add("head packed 3k, torch epilogue", T, timer(lambda: ops.REFERENCE["packed_head"](hidden, buf, ids, K)),
            buf.numel() * 2)
        add("head packed 3k, GEMM only", T, timer(lambda: F.linear(hidden, buf)), buf.numel() * 2)

        tokens = torch.randint(V, (T,), generator=g, device=dev)
        feats = torch.randn(T, d, generator=g, device=dev).to(bf16)
        kv = CONTEXT + torch.arange(T, device=dev)
        span = Span(torch.tensor(CONTEXT, device=dev), causal(T, dev), CONTEXT + T)

        def backbone():
            return draft.hidden(tokens, feats, kv, kv, span, dcache)

        def static_step(kind):
            buf, ids = heads[kind]
            return lambda: ops.packed_head(backbone(), buf, ids, K)

        def microspec_step(gather: str):
            def step():
                rows, slots = update(step_ids)
                cur = torch.cuda.current_stream()
                if gather == "copy stream":  # the paper's pipeline: the copy hides behind the backbone
                    copy.wait_stream(cur)
                    with torch.cuda.stream(copy):
                        ops.gather_rows(head, rows, packed_all, slots)
                elif gather == "compute stream":
                    ops.gather_rows(head, rows, packed_all, slots)
                h = backbone()
                if gather == "copy stream":
                    cur.wait_stream(copy)
                return ops.packed_head(h, packed, id_of, K)
            return step

        def naive_step():
            update(step_ids)
            return ops.packed_head(backbone(), head[id_of.clamp(min=0)], id_of, K)

        steps = {"step full": (static_step("full"), V), "step static 32k": (static_step("static 32k"), STATIC_K),
                 "step static 3k": (static_step("packed 3k"), R),
                 "step microspec": (microspec_step("copy stream"), R),
                 "step microspec, no gather": (microspec_step("none"), R),
                 "step microspec, gather on compute stream": (microspec_step("compute stream"), R),
                 "step naive indexed GEMM (ablation)": (naive_step, R)}
        for kernel, (fn, rows) in steps.items():
            add(kernel, T, timer(fn, feed), backbone_bytes + rows * d * 2)
        logits = F.linear(hidden, buf)
        add("head packed 3k, epilogue only", T, timer(lambda: ops.masked_topk(logits[None], ids[None], K)), None)
    out += round_bookkeeping(name, d, K, g, timer)
    return out


def round_bookkeeping(name: str, d: int, k: int, g: torch.Generator, timer: "Timer", depth: int = 5,
                      N: int = 60) -> list[dict]:
    """A round's tree bookkeeping at one request, the GPU tree's shape (depth 5, top-k, N nodes): one expansion's
    growth (layers.tree_grow) and the selection of the tree from the pool (layers.tree_select), each the fused
    kernel against its torch reference."""
    from plugins import layers

    dev, S, P = DEVICE, depth * k, k + depth * k * k
    cur = -torch.rand(1, k, generator=g, device=dev)
    logp = -torch.rand(1, k, k, generator=g, device=dev) * 6
    tok = torch.randint(1000, (1, k, k), generator=g, device=dev)
    h = torch.randn(1, k, d, generator=g, device=dev).to(torch.bfloat16)
    anc = torch.rand(1, k, S, generator=g, device=dev) < 0.3
    eye = torch.zeros(k, S, dtype=torch.bool, device=dev)
    score = -torch.rand(1, P, generator=g, device=dev).cumsum(1)  # (a pool: its ranks only matter)
    best = torch.randint(k, (1, (depth - 1) * k), generator=g, device=dev)
    pool = torch.randint(1000, (1, P), generator=g, device=dev)
    root = torch.zeros(1, dtype=torch.long, device=dev)
    out = []
    for path, label in ((True, "fused"), (False, "torch reference")):
        with layers.path(path):
            for kernel, fn in ((f"tree grow (k = {k}), {label}", lambda: layers.tree_grow(cur, logp, tok, h, anc, eye)),
                               (f"tree select (P = {P}, N = {N}), {label}",
                                lambda: layers.tree_select(root, pool, score, best, k, N))):
                out.append(dict(shape=name, rows=1, kernel=kernel, us=timer(fn), mb=None, tb_s=None, pct_copy=None,
                                floor_us=None))
    return out


def model_projections(cfg: dict, dev, dtype=torch.bfloat16) -> list[tuple]:
    """Random weights (scaled 1 / sqrt(K)) of one decoder layer's projections, the EAGLE draft's fc and the LM
    head at a model shape of SHAPES: [(name, weight, bias, act)], as layers.linear is called with them."""
    d, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    g = torch.Generator(device=dev).manual_seed(3)

    def w(n, k):
        return (torch.randn(n, k, generator=g, device=dev) / k ** 0.5).to(dtype)

    qkv = (cfg["num_heads"] + 2 * cfg["num_kv_heads"]) * hd
    bias = torch.randn(qkv, generator=g, device=dev).to(dtype) if cfg.get("attention_bias") else None
    act = "gelu" if cfg["arch"] == "gemma3" else "silu"
    return [(f"q|k|v{' (+bias)' if bias is not None else ''}", w(qkv, d), bias, None),
            ("O", w(d, cfg["num_heads"] * hd), None, None), ("gate|up", w(2 * i, d), None, None),
            (f"down ({act} x up)", w(d, i), None, act), ("EAGLE fc (2d -> d)", w(d, 2 * d), None, None),
            ("LM head", w(cfg["vocab_size"], d), None, None)]


def projection_ab(projections: list[tuple], rows: list[int], timer: "Timer", tag: str = "") -> list[dict]:
    """Each projection (name, weight, bias, act) at each row count: cuBLAS (F.linear, after act_mul for the down
    projection), every skinny-GEMM config (the best one kept), and the default path (layers.linear: what the
    model runs, the skinny GEMM where it measured >= 3% faster at first use, else cuBLAS); microseconds, GB/s of
    the bytes the projection must move (weight, bias, input, output), % of peak_bw(). A line per shape as it goes."""
    from plugins import layers
    from plugins import triton_layers as tk

    out = []
    with torch.no_grad():
        for M in rows:
            for name, w, b, act in projections:
                N, K = w.shape
                g = torch.Generator(device=w.device).manual_seed(M)
                x = torch.randn(M, 2 * K if act else K, generator=g, device=w.device).to(w.dtype)
                nbytes = (w.numel() + (0 if b is None else b.numel()) + x.numel() + M * N) * w.element_size()
                cublas = timer(lambda: F.linear(layers.act_mul(x, act == "gelu") if act else x, w, b))
                default = timer(lambda: layers.linear(x, w, b, act))
                skinny = M <= layers.SKINNY_ROWS
                pick = layers.linear_choice(x, w, b, act)["config"] if skinny else None
                best, best_cfg = None, None
                for cfg in tk.skinny_configs(M, N, K, w.dtype == torch.float32) if skinny else []:
                    us = timer(lambda cfg=cfg: tk.skinny_linear(x, w, b, act, cfg))
                    if best is None or us < best:
                        best, best_cfg = us, cfg
                r = dict(rows=M, projection=name, n=N, k=K, mb=nbytes / 1e6, cublas_us=cublas,
                         cublas_gb_s=nbytes / cublas / 1e3, cublas_pct=100 * nbytes / cublas / 1e6 / (peak_bw() / 1e12),
                         skinny_us=best, skinny_config=best_cfg and list(best_cfg),
                         skinny_gb_s=best and nbytes / best / 1e3,
                         skinny_pct=best and 100 * nbytes / best / 1e6 / (peak_bw() / 1e12),
                         default_us=default, default_pct=100 * nbytes / default / 1e6 / (peak_bw() / 1e12),
                         default_runs=f"skinny {tuple(pick)}" if pick else "cuBLAS")
                out.append(r)
                sk = "-" if best is None else (f"{best:7.1f} us {r['skinny_gb_s']:5.0f} GB/s {r['skinny_pct']:3.0f}% "
                                               f"{tuple(best_cfg)}")
                print(f"{tag}rows {M:3d} {name:20s} {N:6d} x {K:5d}: cuBLAS {cublas:7.1f} us "
                      f"{r['cublas_gb_s']:5.0f} GB/s {r['cublas_pct']:3.0f}% | skinny {sk} | default {default:7.1f} us "
                      f"({r['default_runs']})", flush=True)
    return out


def count_kernels(fn) -> int:
    """GPU kernels one eager run of fn launches (torch.profiler; memsets left out)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memset"))


def fused_ab(cfg: dict, rows: list[int], timer: "Timer", tag: str = "") -> list[dict]:
    """The fold of the residual add + RMSNorm into the q|k|v and gate|up GEMMs (layers.norm_linear), and of the
    rotation + KV write into q|k|v's too, against the separate launches (add_rms_norm, linear, rope_cache_write,
    each on its default path): unfused, the fastest fused config, the default (a fold where it measured >= 3%
    faster at first use); then one whole decoder layer at CONTEXT committed tokens with the folds allowed (the
    default) and switched off (layers.FUSE): us and kernels."""
    from plugins import layers
    from plugins import triton_layers as tk

    from ..models.model import Block, rope_tables

    dev, bf16 = DEVICE, torch.bfloat16
    mc = ModelConfig(**cfg, num_layers=1, rms_norm_eps=1e-6, rope_theta=1e6, max_seq_len=CONTEXT + 2 * max(rows),
                     tie_word_embeddings=False)
    with torch.device(dev):
        block = Block(mc).to(bf16).requires_grad_(False)
    at, mlp, norm = block.self_attn, block.mlp, block.post_attention_layernorm
    fold = [("add + RMSNorm + q|k|v", block.input_layernorm.weight, at.qkv_proj.weight, at.qkv_proj.bias),
            ("add + RMSNorm + gate|up", norm.weight, mlp.gate_up_proj.weight, None)]
    g = torch.Generator(device=dev).manual_seed(4)
    rope = rope_tables(mc, mc.rope_theta, 1.0, dev)
    S = CONTEXT + max(rows)
    k = torch.randn(mc.num_kv_heads, S, mc.head_dim, generator=g, device=dev).to(bf16)
    v = torch.randn(mc.num_kv_heads, S, mc.head_dim, generator=g, device=dev).to(bf16)
    k_pos = torch.arange(S, device=dev)
    out = []

    def row(M, piece, unfused, fused, cfg_best, default, runs, nbytes, kernels=None):
        r = dict(rows=M, piece=piece, unfused_us=unfused, fused_us=fused, fused_config=cfg_best and list(cfg_best),
                 default_us=default, default_runs=runs, mb=nbytes / 1e6,
                 fused_pct=fused and 100 * nbytes / fused / 1e6 / (peak_bw() / 1e12),
                 unfused_pct=100 * nbytes / unfused / 1e6 / (peak_bw() / 1e12), kernels=kernels)
        out.append(r)
        print(f"{tag}rows {M:3d} {piece:41s} unfused {unfused:7.1f} us | fused {_us(fused)} "
              f"{cfg_best and tuple(cfg_best)} | default {default:7.1f} us ({runs})"
              + (f" | kernels {kernels}" if kernels else ""), flush=True)

    with torch.no_grad():
        for M in rows:
            res = (torch.randn(M, mc.hidden_size, generator=g, device=dev) * 3).to(bf16)
            delta = torch.randn(M, mc.hidden_size, generator=g, device=dev).to(bf16)
            for piece, nw, w, b in fold:
                nbytes = (w.numel() + (0 if b is None else b.numel()) + 3 * res.numel() + M * w.shape[0]) * 2

                def unfused():
                    return layers.linear(layers.add_rms_norm(res, delta, nw, mc.rms_norm_eps, 0.0)[1], w, b)

                t_unfused = timer(unfused)
                best, best_cfg = None, None
                for c in tk.skinny_configs(M, *w.shape, False) if M <= layers.SKINNY_ROWS else []:
                    us = timer(lambda c=c: tk.skinny_norm_linear(res, delta, nw, mc.rms_norm_eps, 0.0, w, b, c))
                    if best is None or us < best:
                        best, best_cfg = us, c
                t_default = timer(lambda: layers.norm_linear(res, delta, nw, mc.rms_norm_eps, 0.0, w, b))
                pick = (layers.norm_linear_choice(res, delta, nw, mc.rms_norm_eps, 0.0, w, b)["config"]
                        if M <= layers.SKINNY_ROWS else None)
                row(M, piece, t_unfused, best, best_cfg, t_default, f"fused {tuple(pick)}" if pick else "unfused",
                    nbytes)
            # the q|k|v projection with the norm before it and the rotation + KV write after it, in one launch
            nw, w, b = fold[0][1:]
            pos = CONTEXT + torch.arange(M, device=dev)
            rope_args = at.rope_args(rope, pos, pos, None, k_pos, 0, k, v)
            nbytes = (w.numel() + b.numel() + 3 * res.numel() + M * w.shape[0]) * 2

            def unfused():
                h = layers.add_rms_norm(res, delta, nw, mc.rms_norm_eps, 0.0)[1]
                return layers.rope_cache_write(layers.linear(h, w, b), *rope_args)

            t_unfused = timer(unfused)
            best, best_cfg = None, None
            for c in tk.skinny_configs(M, *w.shape, False) if M <= layers.SKINNY_ROWS else []:
                if tk.rope_fits(c, mc.head_dim):
                    us = timer(lambda c=c: tk.skinny_norm_linear(res, delta, nw, mc.rms_norm_eps, 0.0, w, b, c,
                                                                 rope_args[:7]))
                    if best is None or us < best:
                        best, best_cfg = us, c
            t_default = timer(lambda: layers.norm_linear(res, delta, nw, mc.rms_norm_eps, 0.0, w, b,
                                                         rope=rope_args))
            pick = (layers.norm_linear_choice(res, delta, nw, mc.rms_norm_eps, 0.0, w, b, rope_args)["config"]
                    if M <= layers.SKINNY_ROWS else None)
            row(M, "add + RMSNorm + q|k|v + rotary + KV write", t_unfused, best, best_cfg, t_default,
                f"fused {tuple(pick)}" if pick else "not folded", nbytes)
            span = Span(torch.tensor(CONTEXT, device=dev), causal(M, dev), CONTEXT + M)
            args = (rope, pos, pos, span, k_pos, 0, k, v)
            nbytes = sum(p.numel() * 2 for p in block.parameters()) + 2 * k[:, :CONTEXT + M].numel() * 2

            def layer():
                return block(res, delta, None, args)

            t, n = {}, {}
            for fuse in (False, True):
                layers.FUSE = fuse
                try:
                    t[fuse], n[fuse] = timer(layer), count_kernels(layer)
                finally:
                    layers.FUSE = True
            row(M, "whole decoder layer", t[False], None, None, t[True], "fold where faster", nbytes,
                f"{n[False]} unfused, {n[True]} default")
    return out


def _us(v) -> str:
    return "      -   " if v is None else f"{v:7.1f} us"


def fused_lines(rows: list[dict]) -> list[str]:
    lines = ["| rows | piece | MB | unfused us | % peak | fused us (best config) | % peak | config | default us | "
             "default runs | kernels |", "|---:|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        f = "-" if r["fused_us"] is None else f"{r['fused_us']:.1f}"
        fp = "-" if r["fused_pct"] is None else f"{r['fused_pct']:.0f}"
        lines.append(f"| {r['rows']} | {r['piece'].replace('|', chr(92) + '|')} | {r['mb']:.2f} | "
                     f"{r['unfused_us']:.1f} | {r['unfused_pct']:.0f} | {f} | {fp} | "
                     f"{r['fused_config'] and tuple(r['fused_config'])} | {r['default_us']:.1f} | "
                     f"{r['default_runs']} | {r['kernels'] or ''} |")
    return lines


def projection_lines(proj_rows: list[dict]) -> list[str]:
    """The markdown table of projection_ab's rows."""
    def cell(name):
        return name.replace("|", "\\|")

    lines = ["| rows | projection | N x K | MB | cuBLAS us | GB/s | % peak | skinny us | GB/s | % peak | "
             "config (BLOCK_N, BLOCK_K, splits) | skinny / cuBLAS | default us | % peak | default runs |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in proj_rows:
        sk = "- | - | - | - | -" if r["skinny_us"] is None else (
            f"{r['skinny_us']:.1f} | {r['skinny_gb_s']:.0f} | {r['skinny_pct']:.0f} | {tuple(r['skinny_config'])} | "
            f"{r['skinny_us'] / r['cublas_us']:.2f}")
        lines.append(f"| {r['rows']} | {cell(r['projection'])} | {r['n']} x {r['k']} | {r['mb']:.2f} | "
                     f"{r['cublas_us']:.1f} | {r['cublas_gb_s']:.0f} | {r['cublas_pct']:.0f} | {sk} | "
                     f"{r['default_us']:.1f} | {r['default_pct']:.0f} | {r['default_runs']} |")
    return lines


def layers_ab(a, timer: Timer) -> None:
    """bench-kernels --layers: projection_ab at each --shapes model shape, random weights."""
    rows, fused = [], []
    for name in a.shapes:
        print(f"bench-kernels --layers: {name} ...", flush=True)
        rows += [dict(shape=name, **r) for r in
                 projection_ab(model_projections(SHAPES[name], DEVICE), a.rows, timer, tag=f"{name} ")]
        torch.cuda.empty_cache()
        fused += [dict(shape=name, **r) for r in fused_ab(SHAPES[name], a.rows, timer, tag=f"{name} ")]
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, iters=a.iters, peak_bw=peak_bw())
    lines = [f"# bench-kernels --layers on {meta['device']}", "",
             f"torch {meta['torch']}; medians of {a.iters} CUDA-graph replays, L2 flushed before each; random bf16 "
             f"weights of each model's shapes; GB/s of the bytes a projection must move (weight, bias, input, "
             f"output), % of the {peak_bw() / 1e12:.2f} TB/s HBM peak (a large copy reaches "
             f"{copy_bw() / 1e12:.2f} TB/s here: {100 * copy_bw() / peak_bw():.0f}%). skinny: the fastest config; default: "
             f"what layers.linear runs (the skinny GEMM where it measured >= 3% faster than cuBLAS at first use).",
             ""]
    for name in a.shapes:
        lines += [f"## {name}", ""] + projection_lines([r for r in rows if r["shape"] == name]) + [""]
        lines += [f"The residual add + RMSNorm folded into the next GEMM, and the rotation + KV write into q|k|v's "
                  f"(layers.norm_linear), vs the separate launches, and one decoder layer ({CONTEXT} committed tokens) "
                  f"with the folds switched off vs the default:", ""]
        lines += fused_lines([r for r in fused if r["shape"] == name]) + [""]
    write_report(a.out, "\n".join(lines), dict(meta=meta, rows=rows, fused=fused))


# (name, requests, rows each, new slots each, mask) at qwen2.5-1.5b's heads, CONTEXT - 424 = 600 committed slots
# in a graph bound S = CONTEXT: what a round's attention launches see at one request and under load
ATTN_CASES = [("AR decode", 1, 1, 1, "causal"), ("draft step", 1, 10, 30, "draft"), ("tree verify", 1, 60, 60, "tree"),
              ("tree verify, 8 requests", 8, 60, 60, "tree"), ("decode, 64 requests", 64, 1, 1, "causal"),
              ("decode, 256 requests", 256, 1, 1, "causal")]  # the last: where layers.attention_choice measures


def attention_ab(a, timer: Timer) -> None:
    """bench-kernels --attention: the Span attention kernel (triton_layers.attention, its KV-split combine
    included) at the round's shapes, attention_plan's plan against every (BLOCK_M, BLOCK_N, splits, warps)."""
    import itertools

    from plugins import triton_layers
    from plugins.check_layers import random_tree
    from plugins.layers import KV_BLOCK

    cfg = SHAPES["qwen2.5-1.5b"]
    H, KV, D = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    S, n0 = CONTEXT, CONTEXT - 424
    g = torch.Generator().manual_seed(0)
    plans = [p for p in itertools.product([16, 32, 64], [32, 64], [1, 2, 4, 8, 16, 32], [2, 4, 8])
             if not (p[0] == 64 and p[3] == 2)]
    rows = []
    for name, B, T, m, kind in ATTN_CASES:
        print(f"bench-kernels --attention: {name} ...", flush=True)
        blocks = S // KV_BLOCK
        table = torch.randperm(B * blocks + 7, generator=g)[:B * blocks].view(B, blocks).to(DEVICE)
        if kind == "tree":
            new = random_tree(g, T, reach=10)
        elif kind == "draft":
            new = torch.rand(T, m, generator=g) < 0.3
            new[:, m - T:] = torch.eye(T, dtype=torch.bool)
        else:
            new = torch.ones(T, T, dtype=torch.bool).tril()
        span = Span(torch.full((B,), n0, device=DEVICE), new.to(DEVICE).expand(B, T, m).contiguous(), S, table)
        pool = (B * blocks + 7) * KV_BLOCK
        k = torch.randn(KV, pool, D, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(B * T, H, D, device=DEVICE, dtype=torch.bfloat16)
        pos = torch.zeros(pool, dtype=torch.long, device=DEVICE)
        qpos = torch.zeros(B * T, dtype=torch.long, device=DEVICE)
        nbytes = 2 * B * KV * (n0 + m) * D * 2 + 2 * q.numel() * 2

        def fn(plan=None):
            return triton_layers.attention(q, k, v, span, qpos, pos, 0, D ** -0.5, plan)

        auto = triton_layers.attention_plan(T, H // KV, KV, S, D, B=B)
        ref = fn()
        got = {}
        for plan in [auto] + triton_layers.attention_candidates(T, H // KV, KV, S, D, B) + plans:
            if plan in got:
                continue
            out = fn(plan)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            got[plan] = (timer(lambda plan=plan: fn(plan)), err)
        best = min(got, key=lambda p: got[p][0])
        rows.append(dict(case=name, B=B, T=T, m=m, kind=kind, n=n0, S=S, bytes=nbytes, auto=list(auto),
                         auto_us=got[auto][0], best=list(best), best_us=got[best][0],
                         max_err=max(e for _, e in got.values()),
                         top=[[list(p), got[p][0]] for p in sorted(got, key=lambda p: got[p][0])[:6]]))
        print(f"  {name}: plan {auto} {got[auto][0]:.1f} us; best {best} {got[best][0]:.1f} us", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, iters=a.iters)
    lines = [f"# bench-kernels --attention on {meta['device']}", "",
             f"torch {meta['torch']}; medians of {a.iters} CUDA-graph replays, L2 flushed before each; random bf16 "
             f"q / paged KV at qwen2.5-1.5b's heads ({H} q / {KV} kv heads, D {D}), {n0} committed slots each "
             f"behind a random block table, graph bound S = {S}; one call = the kernel + the KV-split combine. "
             f"plan = (BLOCK_M, BLOCK_N, splits, warps); max err: the largest relative error of any plan against "
             f"attention_plan's output.", "",
             "| case | plan (attention_plan) | us | best plan | us | GB/s at best | max err | next best |",
             "|---|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        nxt = ", ".join(f"{tuple(p)} {us:.1f}" for p, us in r["top"][1:4])
        lines.append(f"| {r['case']} | {tuple(r['auto'])} | {r['auto_us']:.1f} | {tuple(r['best'])} | "
                     f"{r['best_us']:.1f} | {r['bytes'] / r['best_us'] / 1e3:.0f} | {r['max_err']:.1e} | {nxt} |")
    write_report(a.out, "\n".join(lines), dict(meta=meta, rows=rows))


def targets(rows: list[dict], launch: float) -> list[dict]:
    """The issue's targets, each per shape and row count where it applies."""
    by = {(r["shape"], r["rows"], r["kernel"].split(" (")[0]): r for r in rows}
    out = []

    def check(what, shape, T, value, limit, unit):
        out.append(dict(target=what, shape=shape, rows=T, value=value, limit=limit, unit=unit,
                        ok=bool(value < limit)))

    for shape in dict.fromkeys(r["shape"] for r in rows):
        upd = by[(shape, "-", "window update")]
        check("window update < 10 us", shape, "-", upd["us"], 10.0, "us")
        for T in sorted({r["rows"] for r in rows if r["shape"] == shape and r["rows"] != "-"}):
            def us(kernel):
                return by[(shape, T, kernel)]["us"]

            h = by[(shape, T, "head packed 3k")]
            check("packed 3k head <= 1.5 x byte floor + launch", shape, T, h["us"], 1.5 * h["floor_us"] + launch,
                  "us")
            check("gather adds < 5% to a microspec step", shape, T,
                  100 * (us("step microspec") / us("step microspec, no gather") - 1), 5.0, "%")
            check("microspec step <= 1.1 x static 3k step", shape, T, us("step microspec") / us("step static 3k"),
                  1.1, "x")
            if shape == "llama3-8b":
                check("microspec step < 0.5 x full step", shape, T, us("step microspec") / us("step full"), 0.5, "x")
    return out


def markdown(rows: list[dict], tgts: list[dict], meta: dict) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [f"# bench-kernels on {meta['device']}", "",
             f"torch {meta['torch']}, ops backend **{meta['backend']}**, W_max {meta['w_max']}, "
             f"{meta['step_ids']} ids per step, top-{meta['top_k']}; medians of {meta['iters']} CUDA-graph replays, "
             f"L2 flushed before each; one empty-kernel replay (launch) = {meta['launch_us']:.1f} us; "
             f"bandwidth against the {meta['copy_bw'] / 1e12:.2f} TB/s copy bandwidth measured here.", "",
             "| shape | rows | kernel | us | byte floor us | MB moved | TB/s | % copy BW |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['rows']} | {r['kernel']} | {r['us']:.1f} | {f(r['floor_us'], '.1f')} | "
                     f"{f(r['mb'], '.1f')} | {f(r['tb_s'], '.2f')} | {f(r['pct_copy'], '.0f')} |")
    lines += ["", "## Targets (measured, not asserted)", "", "| target | shape | rows | value | limit | |",
              "|---|---|---:|---:|---:|---|"]
    for t in tgts:
        lines.append(f"| {t['target']} | {t['shape']} | {t['rows']} | {t['value']:.2f} {t['unit']} | "
                     f"{t['limit']:.2f} {t['unit']} | {'PASS' if t['ok'] else 'MISS'} |")
    met = sum(t["ok"] for t in tgts)
    lines += ["", f"{met} of {len(tgts)} targets met."]
    return "\n".join(lines) + "\n"


def write_report(path: str | None, text: str, data: dict) -> None:
    """Print the markdown; with a path, write it there and the data as JSON beside it (.json)."""
    print(text)
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out} and {out.with_suffix('.json')}")


def run(a) -> None:
    if not torch.cuda.is_available():
        raise UserError("bench-kernels needs a CUDA GPU")
    faulthandler.dump_traceback_later(600, exit=True)  # a hang prints where it is and exits
    import plugins

    if plugins.BACKEND != "cuda":
        print(f"bench-kernels: WARNING: ops run the torch reference (backend {plugins.BACKEND}, "
              f"MICROSPEC_PLUGINS={plugins.MODE}); the figures are the reference's", flush=True)
    timer = Timer(a.iters)
    if a.attention:
        attention_ab(a, timer)
        faulthandler.cancel_dump_traceback_later()
        return
    if a.layers:
        a.shapes, a.rows = a.shapes or ["qwen2.5-1.5b"], a.rows or [1, 4, 16, 32, 60]
        layers_ab(a, timer)
        faulthandler.cancel_dump_traceback_later()
        return
    a.shapes, a.rows = a.shapes or list(SHAPES), a.rows or [1, 10, 60]
    tiny = torch.zeros(1, device="cuda")
    launch = timer(lambda: tiny.add_(1))
    rows = []
    for name in a.shapes:
        print(f"bench-kernels: {name} ...", flush=True)
        rows += bench_shape(name, SHAPES[name], a, timer)
        torch.cuda.empty_cache()
    tgts = targets(rows, launch)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, backend=plugins.BACKEND,
                w_max=a.w_max, step_ids=a.step_ids, top_k=a.top_k, iters=a.iters, launch_us=launch,
                copy_bw=copy_bw())
    write_report(a.out, markdown(rows, tgts, meta), dict(meta=meta, rows=rows, targets=tgts))
    faulthandler.cancel_dump_traceback_later()


def register(sub) -> None:
    p = sub.add_parser("bench-kernels", help="time MicroSpec's kernels and draft steps on the GPU",
                       description=__doc__)
    p.add_argument("--out", help="write the markdown table to this file and JSON beside it (.json)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="model shapes (default: all four; --layers: "
                   "qwen2.5-1.5b)")
    p.add_argument("--rows", nargs="+", type=int, help="hidden-state rows per head call (default 1 10 60; --layers: "
                   "1 4 16 32 60)")
    p.add_argument("--layers", action="store_true", help="instead: the decoder layer's projections, EAGLE's fc and "
                   "the LM head, cuBLAS vs each skinny-GEMM config vs the default path, GB/s and %% of HBM peak")
    p.add_argument("--attention", action="store_true", help="instead: the attention kernel at a round's shapes "
                   "(decode, draft step, tree verify, batches), its plan against every block size / KV split / warps")
    p.add_argument("--iters", type=int, default=30, help="timed replays per figure (median)")
    p.add_argument("--w-max", type=int, default=3072)
    p.add_argument("--step-ids", type=int, default=250, help="ids appended to the window per step")
    p.add_argument("--top-k", type=int, default=10)
    p.set_defaults(func=run)
