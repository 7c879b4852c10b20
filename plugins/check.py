"""`python -m plugins.check`: on the GPU, every CUDA op against the torch reference on random inputs.

Window ops (unique_first_rows, window_update_rows, gather_rows) must agree bit for bit with the reference run on
CPU copies of the same inputs: outputs and the whole window state after every step, one window alone (a batch of
one row) and a batch of windows. packed_head must agree up to
ties: its log-probs equal the top-k of a float64 model within 1e-4, and each returned id carries the log-prob
the model gives that id. One check captures update + gather (copy stream) + head in a CUDA graph and replays
it on fresh inputs; the last runs the batched engine's windows (trtllm_microspec/vocab/batched.py: plain torch
with the gather on the copy stream) on the GPU against the CPU. Prints a PASS/FAIL table; exit status 1 on any failure, 2 without a GPU or kernels.
"""
from __future__ import annotations

import faulthandler
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from . import ops

DEV = "cuda"  # what the checks compare with the reference on CPU (set to "cpu" to test the checker itself)
STATE = ("ring", "head", "count", "slot_of", "id_of", "first")  # window_update_rows' state arguments, in order


def new_window(V: int, W: int, pinned=(), device="cpu", R: int | None = None, slots: int = 1) -> dict:
    """Fresh state of `slots` windows (layout in ops.py), the pinned ids active in the first slots of each;
    R = W + pinned."""
    P = len(pinned)
    R = W + P if R is None else R
    st = dict(ring=torch.full((slots, W + 1), -1), head=torch.zeros(slots, dtype=torch.long),
              count=torch.zeros(slots, V + 1, dtype=torch.int32), slot_of=torch.full((slots, V + 1), -1),
              id_of=torch.full((slots, R + 1), -1), first=torch.full((slots, V + 1), ops.BIG))
    p = torch.tensor(list(pinned), dtype=torch.long)
    st["count"][:, p] = 1
    st["slot_of"][:, p] = torch.arange(P)
    st["id_of"][:, :P] = p
    return {k: v.to(device) for k, v in st.items()}


def alone(device="cpu") -> torch.Tensor:
    """The batch [1] of a window op's call on window 0 alone: one row."""
    return torch.zeros(1, dtype=torch.long, device=device)


def stream_ids(g: torch.Generator, V: int, n: int, pad: float) -> torch.Tensor:
    """n ids: 70% from a small hot set (duplicates within and across appends), the rest uniform; some -1."""
    hot = torch.randint(V, (max(1, min(V, 64)),), generator=g)
    ids = torch.where(torch.rand(n, generator=g) < 0.7, hot[torch.randint(hot.numel(), (n,), generator=g)],
                      torch.randint(V, (n,), generator=g))
    return torch.where(torch.rand(n, generator=g) < pad, -1, ids)


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of different lengths -> [B, n], -1 padded (BatchWindow.start's input)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)


def exact_inputs(g: torch.Generator, *shape, dtype=torch.bfloat16) -> torch.Tensor:
    """Multiples of 1/8 in [-1/2, 1/2]: every GEMM over them is exact in fp32, whatever the summation order."""
    return (torch.randint(-4, 5, shape, generator=g).float() / 8).to(dtype)


def diff(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (got != want).nonzero()
    if bad.numel():
        i = tuple(bad[0].tolist())
        return f"{name}: {bad.shape[0]} entries differ, first at {i}: {got[i].item()} != {want[i].item()}"
    return None


def worst(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def head_error(logp, ids, model_logp, id_of, k, tol=1e-4) -> str | None:
    """None if (logp, ids) [T, k] is a top-k of model_logp [T, R] (per slot, float64) up to ties."""
    logp, ids, model_logp, id_of = logp.cpu().double(), ids.cpu(), model_logp.cpu(), id_of.cpu()
    want = model_logp.topk(k).values
    got = logp.sort(-1, descending=True).values
    if not torch.equal(torch.isinf(got), torch.isinf(want)) or worst((got - want)[torch.isfinite(want)]) > tol:
        return f"log-probs differ from the model's top-{k}: max error {(got - want).nan_to_num().abs().max():.2e}"
    fin = torch.isfinite(logp)
    if bool((ids[~fin] != 0).any()):
        return "an -inf entry does not map to id 0"
    slot_of = torch.full((int(max(id_of.max(), ids.max())) + 1,), -1, dtype=torch.long)
    slot_of[id_of[id_of >= 0]] = torch.nonzero(id_of >= 0).flatten()
    slot = slot_of[ids]
    if bool((slot[fin] < 0).any()):
        return "an id that holds no slot was returned"
    got_model = model_logp.gather(1, slot.clamp(min=0))
    err = worst((got_model - logp)[fin])
    if err > tol:
        return f"a returned id's log-prob differs from the model's for that id by {err:.2e}"
    for t in range(ids.shape[0]):
        row = ids[t][fin[t]]
        if row.unique().numel() != row.numel():
            return f"row {t} repeats an id"
    return None


def model_logp(hidden, packed, id_of) -> torch.Tensor:
    """float64 log-softmax over the slots, of logits rounded to the GEMM's output dtype."""
    logits = (hidden.double() @ packed.double().T).to(hidden.dtype).double()
    return torch.log_softmax(logits.masked_fill(id_of < 0, float("-inf")), -1)


def check_unique_first() -> str:
    """ops.unique_first_rows on one row (one window alone), up to the real vocabulary."""
    g = torch.Generator().manual_seed(0)
    cases = [(10, 50, 0.1), (1000, 1, 0.0), (128256, 20000, 0.1), (100, 0, 0.0), (100, 64, 1.0), (5, 3000, 0.3)]
    for V, n, pad in cases:
        ids = stream_ids(g, V, n, pad)[None]
        first_c, first_g = torch.full((1, V + 1), ops.BIG), torch.full((1, V + 1), ops.BIG, device=DEV)
        want = ops.unique_first_rows(ids, first_c, alone())
        got = ops.unique_first_rows(ids.to(DEV), first_g, alone(DEV))
        err = diff(f"V={V} n={n}: output", got, want) or diff(f"V={V} n={n}: first", first_g, first_c)
        if err:
            raise AssertionError(err)
    return f"{len(cases)} cases up to n=20000, duplicates and padding"


def check_window_update() -> str:
    """ops.window_update_rows on one window alone (a batch of one row), up to the real shapes."""
    g = torch.Generator().manual_seed(1)
    # (V, W, pinned, R or None, append sizes): tiny windows with appends longer than W, empty and all-padding
    # appends, the real shape (W=3072, 128k vocabulary) with a long first append, and too few slots (R < W)
    cases = [(40, 8, [], None, [5, 20, 0, 3, 9, 1, 30, 64, 2]),
             (300, 32, [0, 7], None, [40, 10, 25, 33, 1, 64, 0, 100]),
             (128256, 3072, [1, 128001], None, [10000] + [250, 60, 130] * 12),
             (2000, 256, [3], None, [600] + [250] * 10),
             (500, 64, [], 40, [80, 30, 30, 90, 10])]
    steps = 0
    for V, W, pinned, R, sizes in cases:
        cpu, gpu = new_window(V, W, pinned, R=R), new_window(V, W, pinned, DEV, R=R)
        for step, n in enumerate(sizes):
            ids = stream_ids(g, V, n, pad=1.0 if step == 3 else 0.1)[None]  # step 3: all padding
            want = ops.window_update_rows(*(cpu[k] for k in STATE), ids, alone())
            got = ops.window_update_rows(*(gpu[k] for k in STATE), ids.to(DEV), alone(DEV))
            where = f"V={V} W={W} step {step} (n={n})"
            errs = [diff(f"{where}: {name}", got[i], want[i]) for i, name in enumerate(("ids", "slots"))]
            errs += [diff(f"{where}: {k}", gpu[k], cpu[k]) for k in STATE]
            if any(errs):
                raise AssertionError(next(e for e in errs if e))
            steps += 1
    return f"{len(cases)} windows, {steps} steps, state compared after each"


def check_rows_ops() -> str:
    """ops.unique_first_rows and ops.window_update_rows over a batch of windows (one CUDA block per row) on the
    GPU against the CPU reference, and each row against the same op on its window alone: appends to a random
    subset of the windows in random order, longer than W and empty ones, padding rows (all -1) that repeat one
    window; state, outputs and every window compared after each step."""
    g = torch.Generator().manual_seed(7)
    V, W, pinned, S, steps = 3000, 64, [0, 2999], 6, 12
    single = [new_window(V, W, pinned) for _ in range(S)]
    cpu = new_window(V, W, pinned, slots=S)
    gpu = {k: v.to(DEV, copy=True) for k, v in cpu.items()}
    for step in range(steps):
        real = torch.randperm(S - 1, generator=g)[:1 + step % (S - 1)]  # window S-1: the padding rows'
        n = [0, 5, 80, 200][step % 4]
        pads = step % 3
        batch = torch.cat([real, torch.full((pads,), S - 1)])
        ids = torch.stack([stream_ids(g, V, n, 0.1) for _ in real] + [torch.full((n,), -1)] * pads) \
            if len(batch) else torch.zeros(0, n, dtype=torch.long)
        where = f"step {step} (B={len(batch)}, n={n})"
        first_c, first_g = torch.full((S, V + 1), ops.BIG), torch.full((S, V + 1), ops.BIG, device=DEV)
        want_u = ops.unique_first_rows(ids, first_c, batch)
        errs = [diff(f"{where}: unique_first_rows", ops.unique_first_rows(ids.to(DEV), first_g, batch.to(DEV)),
                     want_u), diff(f"{where}: unique_first_rows scratch", first_g, first_c)]
        errs += [diff(f"{where}: unique_first_rows row {b}", want_u[b],
                      ops.unique_first_rows(ids[b:b + 1], torch.full((1, V + 1), ops.BIG), alone())[0])
                 for b in range(len(real))]
        want = ops.window_update_rows(*(cpu[k] for k in STATE), ids, batch)
        got = ops.window_update_rows(*(gpu[k] for k in STATE), ids.to(DEV), batch.to(DEV))
        errs += [diff(f"{where}: {name}", got[i], want[i]) for i, name in enumerate(("ids", "slots"))]
        errs += [diff(f"{where}: {k}", gpu[k], cpu[k]) for k in STATE]
        for b, w in enumerate(real.tolist()):
            one = ops.window_update_rows(*(single[w][k] for k in STATE), ids[b:b + 1], alone())
            errs += [diff(f"{where}: row {b} {name} vs alone", want[i][b], one[i][0]) for i, name in
                     enumerate(("ids", "slots"))]
        errs += [diff(f"{where}: window {w}: {k} vs alone", cpu[k][w], single[w][k][0]) for w in range(S) for k in STATE]
        if any(errs):
            raise AssertionError(next(e for e in errs if e))
    return f"{S} windows, {steps} steps (padding rows, empty appends), vs the CPU and each window alone"


def check_gather_rows() -> str:
    g = torch.Generator().manual_seed(2)
    # (V, d, dtype, R, n rows, padded rows): the model widths, a full 3k refill, an odd row size that takes
    # the unvectorised path, nothing to copy
    cases = [(1000, 4096, torch.bfloat16, 400, 300, 200), (5000, 1536, torch.bfloat16, 3072, 3072, 0),
             (2000, 3584, torch.bfloat16, 3074, 60, 440), (300, 64, torch.float32, 20, 10, 5),
             (100, 7, torch.float16, 50, 40, 3), (50, 2048, torch.bfloat16, 8, 0, 0)]
    for V, d, dtype, R, n, pad in cases:
        src = torch.randn(V, d, generator=g).to(dtype)
        dst = torch.randn(R + 1, d, generator=g).to(dtype)
        ids = torch.cat([torch.randint(V, (n,), generator=g), torch.zeros(pad, dtype=torch.long)])
        slots = torch.cat([torch.randperm(R, generator=g)[:n], torch.full((pad,), R)])
        perm = torch.randperm(n + pad, generator=g)  # padding interleaved, as window_update_rows returns it
        ids, slots = ids[perm], slots[perm]
        want, got = dst.clone(), dst.to(DEV)
        ops.gather_rows(src, ids, want, slots)
        ops.gather_rows(src.to(DEV), ids.to(DEV), got, slots.to(DEV))
        err = diff(f"V={V} d={d} {dtype} n={n}: dst[:R]", got[:R], want[:R])  # dst[R] is the padding sink
        if err:
            raise AssertionError(err)
    return f"{len(cases)} cases, bf16/fp16/fp32, padded rows interleaved"


def head_cases(g):
    # (T, R, d, k, share of empty slots): the draft shapes, the largest fused R, the torch-epilogue path
    # (R > fused rows), fewer active slots than k
    for T, R, d, k, empty in [(1, 3074, 4096, 10, 0.02), (10, 3074, 2048, 10, 0.1), (60, 3074, 1536, 10, 0.1),
                              (7, 8192, 256, 32, 0.3), (5, 20000, 128, 10, 0.1), (3, 16, 64, 10, 0.75),
                              (4, 100, 64, 1, 0.0)]:
        id_of = torch.randperm(200000, generator=g)[:R]
        id_of[torch.rand(R, generator=g) < empty] = -1
        yield T, R, d, k, id_of


def check_packed_head_exact() -> str:
    g = torch.Generator().manual_seed(3)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # keep the fp32 sum exact
    n = 0
    for T, R, d, k, id_of in head_cases(g):
        hidden, packed = exact_inputs(g, T, d).to(DEV), exact_inputs(g, R, d).to(DEV)
        logp, ids = ops.packed_head(hidden, packed, id_of.to(DEV), k)
        err = head_error(logp, ids, model_logp(hidden.cpu(), packed.cpu(), id_of), id_of, k)
        if err:
            raise AssertionError(f"T={T} R={R} d={d} k={k}: {err}")
        n += 1
    return f"{n} cases (R up to 20000, T up to 60, k up to 32) vs an exact float64 model"


def check_packed_head_random() -> str:
    g = torch.Generator().manual_seed(4)
    n = 0
    for T, R, d, k, id_of in head_cases(g):
        hidden = torch.randn(T, d, generator=g).to(torch.bfloat16).to(DEV)
        packed = (torch.randn(R, d, generator=g) / d ** 0.5).to(torch.bfloat16).to(DEV)
        id_of = id_of.to(DEV)
        logits = F.linear(hidden, packed).double()  # the GEMM both sides share
        model = torch.log_softmax(logits.masked_fill(id_of < 0, float("-inf")), -1)
        for name, fn in (("cuda", ops.packed_head), ("reference", ops.REFERENCE["packed_head"])):
            err = head_error(*fn(hidden, packed, id_of, k), model, id_of, k)
            if err:
                raise AssertionError(f"{name} T={T} R={R} k={k}: {err}")
        n += 1
    return f"{n} cases on random normal bf16, the op and the torch reference on the same GPU logits"


def check_packed_head_nan() -> str:
    """NaN logits (a padding row's uninitialised packed rows or hidden): the kernel counts them as -inf, so a row
    with a few is the top-k of the rest, and a row of NaN only still returns k distinct real ids (or 0), never an
    id from outside the row (the draft embeds what it returns)."""
    g = torch.Generator().manual_seed(6)
    T, R, d, k = 6, 3074, 256, 10
    id_of = torch.randperm(200000, generator=g)[:R]
    hidden = torch.randn(T, d, generator=g).to(torch.bfloat16)
    packed = (torch.randn(R, d, generator=g) / d ** 0.5).to(torch.bfloat16)
    nan_slot = torch.rand(R, generator=g) < 0.05
    packed[nan_slot] = float("nan")
    hidden[-1] = float("nan")
    logp, ids = ops.packed_head(hidden.to(DEV), packed.to(DEV), id_of.to(DEV), k)
    logp, ids = logp.cpu(), ids.cpu()
    clean = id_of.masked_fill(nan_slot, -1)
    err = head_error(logp[:-1], ids[:-1], model_logp(hidden[:-1], packed.nan_to_num(0.0), clean), clean, k)
    if err:
        raise AssertionError(f"rows with NaN slots: {err}")
    last = ids[-1]
    if last.unique().numel() != k or not bool(torch.isin(last, id_of).all()):
        raise AssertionError(f"a row of NaN returned ids {last.tolist()}: not {k} distinct ids of the row")
    return f"R={R}: 5% NaN slots, one row of NaN"


def check_graph() -> str:
    """update + gather on a copy stream + head, captured once, replayed on new appends; vs the CPU reference."""
    g = torch.Generator().manual_seed(5)
    V, W, d, k, n, T, pinned = 5000, 200, 256, 10, 256, 10, [2, 4999]
    head_c = exact_inputs(g, V, d)
    hidden_c = exact_inputs(g, T, d)
    cpu, gpu = new_window(V, W, pinned), new_window(V, W, pinned, DEV)
    R = W + len(pinned)
    id_of_c, id_of_g = cpu["id_of"][0, :R], gpu["id_of"][0, :R]  # the window's packed slots
    packed_c = torch.zeros(R + 1, d, dtype=torch.bfloat16)
    ops.gather_rows(head_c, torch.tensor(pinned), packed_c, torch.arange(len(pinned)))
    head_g, hidden_g, packed_g = head_c.to(DEV), hidden_c.to(DEV), packed_c.to(DEV)
    new_ids = torch.full((1, n), -1, device=DEV)  # static input: appends shorter than n are padded with -1
    batch = alone(DEV)
    copy = torch.cuda.Stream()

    def step():
        rows, slots = ops.window_update_rows(*(gpu[k] for k in STATE), new_ids, batch)
        copy.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy):
            ops.gather_rows(head_g, rows[0], packed_g, slots[0])
        torch.cuda.current_stream().wait_stream(copy)
        return ops.packed_head(hidden_g, packed_g[:R], id_of_g, k)

    side = torch.cuda.Stream()  # warm-up (all padding: leaves the state as it is), then capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logp, ids = step()
    replays = 8
    for r in range(replays):
        m = [n, 37, 0, 256, 120, 1, 200, 256][r]
        appended = stream_ids(g, V, m, pad=0.1)
        new_ids.fill_(-1)
        new_ids[0, :m].copy_(appended)
        graph.replay()
        torch.cuda.synchronize()
        rows, slots = ops.window_update_rows(*(cpu[k] for k in STATE),
                                             torch.cat([appended, torch.full((n - m,), -1)])[None], alone())
        ops.gather_rows(head_c, rows[0], packed_c, slots[0])
        errs = [diff(f"replay {r}: {k}", gpu[k], cpu[k]) for k in STATE]
        errs.append(diff(f"replay {r}: packed rows", packed_g[:R], packed_c[:R]))
        live = id_of_c >= 0
        errs.append(diff(f"replay {r}: packed rows vs head rows", packed_c[:R][live], head_c[id_of_c[live]]))
        err = head_error(logp, ids, model_logp(hidden_c, packed_c[:R], id_of_c), id_of_c, k)
        errs.append(err and f"replay {r}: packed_head: {err}")
        if any(errs):
            raise AssertionError(next(e for e in errs if e))
    return f"{replays} replays of one capture (copy stream + join), state, packed rows and head checked"


def check_batch_window() -> str:
    """trtllm_microspec's BatchWindow (the windows of a batch, plain torch, gathers on the copy stream, with a fill)
    on the GPU against the same on the CPU: the whole state, the fill and the active packed rows after every round;
    each request's draft head (one bmm over the slots, one GEMM over the fill rows) against the float64 model of its
    own rows."""
    from trtllm_microspec.vocab.batched import BatchWindow

    g = torch.Generator().manual_seed(6)
    # W 2048: the small slots' windows stay thin (their fill large), the large slots' wrap
    V, W, d, k, T, slots, pinned = 50000, 2048, 256, 10, 10, 8, [2, 49999]
    head = exact_inputs(g, V, d)
    fill = torch.randperm(V, generator=g)[:W]
    cpu, gpu = BatchWindow(head, W, pinned, slots, fill), BatchWindow(head.to(DEV), W, pinned, slots, fill)
    state = ("ring", "head_pos", "count", "slot_of", "id_of", "first", "fill_id_of")
    joins = {0: [5, 0, 3], 7: [1, 6], 15: [0]}  # round -> slots whose request joins then (0 again at 15)
    running, rounds = [], 30
    for r in range(rounds):
        if r in joins:  # the round's joins start in one call, as the runner's prompt pass starts them
            prompts, topks = [], []
            for slot in joins[r]:
                prompts.append(stream_ids(g, V, 300 + 500 * slot, 0.0))
                topks.append(stream_ids(g, V, 3 * (300 + 500 * slot), 0.0))
            new, prompts, topks = torch.tensor(joins[r]), padded(prompts), padded(topks)
            cpu.start(new, prompts, topks)
            gpu.start(new.to(DEV), prompts.to(DEV), topks.to(DEV))
            gpu.join()  # as the runner's prefill does: the gather's inputs live until the copy stream is done
            running = sorted(set(running) | set(joins[r]))
        batch = torch.tensor(running)
        tree, ver = stream_ids(g, V, 59 * len(running), 0.0), stream_ids(g, V, 18 * len(running), 0.5)
        cpu.update(batch, tree.view(len(running), 59), ver.view(len(running), 18))
        gpu.update(batch.to(DEV), tree.view(len(running), 59).to(DEV), ver.view(len(running), 18).to(DEV))
        gpu.join()
        errs = [diff(f"round {r}: {name}", getattr(gpu, name), getattr(cpu, name)) for name in state]
        live = cpu.id_of[:, :cpu.R] >= 0
        errs.append(diff(f"round {r}: packed rows", gpu.packed[:, :cpu.R][live.to(DEV)], cpu.packed[:, :cpu.R][live]))
        hidden = exact_inputs(g, len(running), T, d)
        logp, ids = gpu.head(hidden.to(DEV), batch.to(DEV), max(running) + 1, k)
        for b, slot in enumerate(running):
            id_of = torch.cat([cpu.fill_id_of[slot], cpu.id_of[slot, :cpu.R]])
            rows = torch.cat([cpu.fill_rows, cpu.packed[slot, :cpu.R]])
            err = head_error(logp[b], ids[b], model_logp(hidden[b], rows, id_of), id_of, k)
            errs.append(err and f"round {r}: slot {slot}: head: {err}")
        if any(errs):
            raise AssertionError(next(e for e in errs if e))
    return f"{slots} slots, {rounds} rounds with joins and a rejoin, state, fill, packed rows and bmm head checked"


CHECKS = [("unique_first_rows, one window", check_unique_first),
          ("window_update_rows, one window", check_window_update),
          ("unique_first_rows, window_update_rows, batch", check_rows_ops),
          ("gather_rows", check_gather_rows), ("packed_head, exact inputs", check_packed_head_exact),
          ("packed_head vs reference, random", check_packed_head_random),
          ("packed_head, NaN logits", check_packed_head_nan), ("CUDA graph replay", check_graph),
          ("batched window", check_batch_window)]


def main() -> int:
    faulthandler.dump_traceback_later(600, exit=True)  # a hang prints where it is and exits instead
    if not torch.cuda.is_available():
        print("plugins.check: FAIL: no CUDA device (the CPU path runs the reference; see tests/test_ops.py)")
        return 2
    import plugins

    if plugins.BACKEND != "cuda":
        print(f"plugins.check: FAIL: the CUDA kernels are not registered (MICROSPEC_PLUGINS={plugins.MODE}); "
              "build them with `python build_scripts/build_plugins.py` to see the compiler's error")
        return 2
    print(f"plugins.check on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows, failed = [], 0
    for name, fn in CHECKS:
        t = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as e:
            detail, ok = f"{type(e).__name__}: {e}", False
            traceback.print_exc()
            failed += 1
        rows.append((name, "PASS" if ok else "FAIL", f"{time.perf_counter() - t:5.1f}s", detail))
        print(f"  {rows[-1][1]} {name}", flush=True)
    w = max(len(r[0]) for r in rows)
    print(f"\n| {'op':{w}s} | result | time   | detail\n|{'-' * (w + 2)}|--------|--------|--------")
    for name, res, t, detail in rows:
        print(f"| {name:{w}s} | {res}   | {t} | {detail}")
    print(f"\n{'ALL PASS' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
