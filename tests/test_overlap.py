"""The overlapped step (engine/scheduler.py `overlap`): an AR step (prompt chunks and decode rows, or decode rows
alone) is launched before the previous step's tokens are read, its decode rows' input tokens taken on the device,
and the host emits each step's tokens one step late.
On the CPU in fp32 with SmolLM2-135M: every request gets exactly the tokens it gets alone and with overlap off
(greedy and seeded sampling), EOS / max-token / length finishes drop the extra row's token, streaming order holds,
cancel and preemption drain the step in flight, and every block and batch slot comes back."""
from __future__ import annotations

import itertools

import pytest

from trtllm_microspec import LLM
from trtllm_microspec.engine.block_manager import GIB, block_bytes
from trtllm_microspec.speculative.sampling import GREEDY, SamplingParams

from test_engine_step import alone, check_budget, check_pool, prompts

CHATS = ["What is the capital of France?", "Hi", "Name three colours."]  # end at EOS within their budgets


@pytest.fixture(scope="module")
def sync(engine_dir):
    return LLM(engine_dir, "ar", device="cpu", max_batch=8, max_num_tokens=64, overlap=False)


@pytest.fixture(scope="module")
def over(engine_dir):
    return LLM(engine_dir, "ar", device="cpu", max_batch=8, max_num_tokens=64, overlap=True)


def counted(sched, monkeypatch) -> list[int]:
    """[overlapped launches with prompt chunks, without, synchronous steps] of the scheduler's runner."""
    n = [0, 0, 0]
    runner, launch, step = sched.runner, sched.runner.step_async, sched.runner.step

    def counting_launch(chunks, decodes):
        n[0 if chunks else 1] += 1
        return launch(chunks, decodes)

    def counting_step(chunks, decodes):
        n[2] += 1
        return step(chunks, decodes)
    monkeypatch.setattr(runner, "step_async", counting_launch)
    monkeypatch.setattr(runner, "step", counting_step)
    return n


def drive(sched, reqs) -> dict:
    """Step until every request is done; each step's emitted tokens checked against the request's output (the
    streaming order); returns each request's tokens as streamed."""
    streamed = {r.rid: [] for r in reqs}
    while not all(r.done for r in reqs):
        emitted = sched.step()
        assert len({req for req, _ in emitted}) == len(emitted)  # a request once a step (serving ends on done)
        for req, toks in emitted:
            assert not toks or req.out[-len(toks):] == toks
            streamed[req.rid] += toks
    return streamed


def workload(llm):
    ids = prompts(14, [1, 200, 17, 90, 40, 3, 150, 33, 64, 2], seed=5)
    ids += [llm.prompt_ids(c, chat=True) for c in CHATS]
    budgets = [3 + (i * 7) % 13 for i in range(len(ids) - len(CHATS))] + [24] * len(CHATS)
    params = [SamplingParams(temperature=0.8, seed=11 + i) if i % 4 == 1 else
              SamplingParams(temperature=1.1, top_k=30, seed=3) if i % 4 == 3 else GREEDY for i in range(len(ids))]
    return ids, budgets, params


def test_overlap_equals_alone_and_sync(sync, over, monkeypatch):
    """17 requests of 1 to 200 prompt tokens over 8 batch slots, greedy and sampled, some ending at EOS: with
    overlap each equals its run alone and its run with overlap off; most decode-only steps overlapped."""
    ids, budgets, params = workload(over)
    want = [alone(sync, p, m, s) for p, m, s in zip(ids, budgets, params)]
    assert any(w[-1] in sync.target.cfg.eos_ids and len(w) < 24 for w in want[-len(CHATS):])  # an EOS finish
    outs = {}
    for llm in (sync, over):
        sched = llm.scheduler()
        sched.history.clear()
        n = counted(sched, monkeypatch)
        reqs = [sched.add(p, m, s) for p, m, s in zip(ids, budgets, params)]
        streamed = drive(sched, reqs)
        outs[llm.overlap] = [r.out for r in reqs]
        for r in reqs:
            assert streamed[r.rid] == r.out  # each token streamed once, in order; no dropped row's token
            assert r.stats.new_tokens == len(r.out) and r.stats.stop_reason in ("eos", "max_tokens")
        if llm.overlap:
            assert n[0] >= 5 and n[1] >= 20 and n[2] == 0, n  # every step overlapped, with chunks or not
        else:
            assert n[:2] == [0, 0] and n[2] >= 25, n
        sched.step()
        check_pool(sched)
        assert sched.pending is None
        check_budget(sched, 64)
    for i, w in enumerate(want):
        assert outs[True][i] == w, f"request {i} with overlap differs from its run alone"
    assert outs[True] == outs[False]


def test_overlap_length_finish(engine_dir, sync):
    """A request that reaches max_seq_len at step N already has a row in step N + 1: it stops at "length" with
    the tokens it gets without overlap (a budget past the cache)."""
    outs = []
    for overlap in (False, True):
        llm = LLM(engine_dir, "ar", device="cpu", max_batch=4, max_seq_len=48, overlap=overlap)
        sched = llm.scheduler()
        ids = prompts(3, [40, 10, 25], seed=7)
        reqs = [sched.add(p, 30) for p in ids]
        drive(sched, reqs)
        assert reqs[0].stats.stop_reason == "length" and len(reqs[0].out) < 30
        outs.append([r.out for r in reqs])
        sched.step()
        check_pool(sched)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("tight", [False, True])
def test_overlap_cancel(engine_dir, over, sync, tight):
    """Cancelled while decoding with a step in flight: it keeps the tokens it was given (a prefix of its tokens
    alone), the one in flight is dropped; the others still get their tokens alone; every block comes back. tight:
    a pool of 8 blocks, so that the next step drains first (fewer free blocks than running requests: the drain
    comes before the boundary that lets the request go) and the token must be dropped there too, not emitted to a
    request its caller has let go (serving: a job already ended)."""
    c = sync.target.cfg
    llm = LLM(engine_dir, "ar", device="cpu", max_batch=4, max_num_tokens=64,
              kv_memory=8 * block_bytes(c, sync.target.cache.k.dtype) / GIB, overlap=True) if tight else over
    ids = prompts(3, [40, 12, 50], seed=8)
    want = [alone(sync, p, 30) for p in ids]
    sched = llm.scheduler()
    reqs = [sched.add(p, 30) for p in ids]
    victim, given = reqs[1], None
    while not all(r.done for r in reqs):
        emitted = sched.step()
        assert given is None or victim not in [r for r, _ in emitted]
        if given is None and len(victim.out) >= 5 and not victim.done:
            assert sched.pending and (victim, False) in sched.pending.rows  # its next token in flight
            assert (len(sched.blocks.free) < len(sched.running)) == tight  # does the next step drain first?
            sched.cancel(victim)
            given = list(victim.out)
    assert victim.stats.stop_reason == "cancelled" and victim.out == given and len(given) < 30
    assert victim.out == want[1][:len(victim.out)]
    assert [reqs[0].out, reqs[2].out] == [want[0], want[2]]
    sched.step()
    check_pool(sched)


def test_overlap_read_order(over, sync, monkeypatch):
    """What the GPU path rests on, with a stand-in for the CUDA event: a step's tokens are read only after its
    event was waited on, and step N's wait comes after step N + 1 was launched (the host never waits for the step
    it just launched); the requests still get their tokens alone."""
    log = []
    runner, real = over.scheduler().runner, over.scheduler().runner.step_async

    class Event:
        def __init__(self, i):
            self.i = i

        def synchronize(self):
            log.append(("wait", self.i))

    class Tokens:
        def __init__(self, t, i):
            self.t, self.i = t, i

        def tolist(self):
            assert ("wait", self.i) in log, f"step {self.i}'s tokens read before its event"
            log.append(("read", self.i))
            return self.t.tolist()

    def launch(chunks, decodes):
        rows, tokens, event = real(chunks, decodes)
        i = sum(1 for e in log if e[0] == "launch")
        log.append(("launch", i))
        return rows, Tokens(tokens, i), Event(i)
    monkeypatch.setattr(runner, "step_async", launch)
    ids = prompts(3, [30, 5, 60], seed=4)
    sched = over.scheduler()
    reqs = [sched.add(p, 12) for p in ids]
    drive(sched, reqs)
    sched.step()
    assert [r.out for r in reqs] == [alone(sync, p, 12) for p in ids]
    launches = [i for kind, i in log if kind == "launch"]
    assert launches == list(range(len(launches))) and len(launches) >= 12
    for i in launches:
        assert log.index(("wait", i)) < log.index(("read", i))
        if i + 1 in launches:  # a roomy pool: no step drains before its launch
            assert log.index(("launch", i + 1)) < log.index(("wait", i))


def test_overlap_preempted_equal_alone(engine_dir, sync, monkeypatch):
    """A pool of 7 blocks for 6 requests that outgrow it: with overlap, decode-only steps overlap while the pool
    has room, a step that might preempt drains first, and the preempted requests (sampled ones too) are
    recomputed to their tokens alone."""
    c = sync.target.cfg
    small = LLM(engine_dir, "ar", device="cpu", max_batch=6, max_num_tokens=64,
                kv_memory=7 * block_bytes(c, sync.target.cache.k.dtype) / GIB, overlap=True)
    ids = prompts(6, [40, 100, 70, 55, 90, 45], seed=1)
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.9, seed=7), GREEDY,
              SamplingParams(temperature=1.1, top_k=40, seed=4), SamplingParams(temperature=0.7, top_p=0.9, seed=5)]
    want = [alone(sync, p, 40, s) for p, s in zip(ids, params)]
    sched = small.scheduler()
    n = counted(sched, monkeypatch)
    reqs = [sched.add(p, 40, s) for p, s in zip(ids, params)]
    drive(sched, reqs)
    assert [r.out for r in reqs] == want
    assert sum(rec.preempted for rec in sched.history) >= 3 and any(r.preemptions and r.resumed > 1 for r in reqs)
    assert n[0] >= 3 and n[1] >= 10 and n[2] == 0, n
    sched.step()
    check_pool(sched)


def test_overlap_failed_chunk(over, sync):
    """A launch with prompt chunks that fails fails the requests of those chunks; the others' decodes launch
    again without them and keep their tokens alone; every block comes back."""
    sched = over.scheduler()
    ok = sched.add([1, 2, 3], 6)
    sched.step()  # ok's prompt is in; bad comes after
    bad = sched.add([4, 5, 6], 4)
    real = sched.runner.step_async

    def launch(chunks, decodes):
        if any(req is bad for req, _ in chunks):
            raise RuntimeError("boom")
        return real(chunks, decodes)
    sched.runner.step_async = launch
    try:
        drive(sched, [ok, bad])
    finally:
        del sched.runner.step_async
    assert bad.stats.stop_reason == "error" and "boom" in bad.error
    assert ok.out == alone(sync, [1, 2, 3], 6)
    sched.step()
    check_pool(sched)


def test_overlap_stream(over, sync):
    """LLM.stream with overlap: the pieces, a step late, make the text and tokens of the run without overlap;
    stopping it early (send True) keeps the tokens it was given."""
    want = sync.generate(CHATS[0], 24, chat=True)
    gen = over.stream_tokens(CHATS[0], 24, chat=True)
    pieces, ids = [], []
    try:
        while True:
            piece, toks = next(gen)
            pieces.append(piece)
            ids += toks
    except StopIteration as stop:
        got = stop.value
    assert "".join(pieces) == want.text and ids == want.token_ids == got.token_ids
    gen = over.stream_tokens(CHATS[0], 24, chat=True)
    ids = list(next(gen)[1]) + list(next(gen)[1])
    try:
        ids += gen.send(True)[1]
        while True:
            ids += next(gen)[1]
    except StopIteration as stop:
        got = stop.value
    assert got.stats["stop_reason"] == "stopped" and got.token_ids == ids == want.token_ids[:len(ids)]
    assert over.scheduler().blocks.used == 0


def test_speculative_plain_steps_overlap(engine_dir, sync, monkeypatch):
    """MicroSpec with the shipped head, the policy made to run plain steps (AR's step, the draft's rows kept in
    the lag buffer: overlapped) between rounds and mixed steps (synchronous: the step in flight is read first), 9
    requests of 1-90 prompt tokens over 4 batch slots, greedy and sampled, the chats ending at EOS: each request
    gets its tokens alone, with overlap on and off; a step's tokens are streamed once, a request once a step;
    every block and slot comes back."""
    ids = prompts(6, [1, 90, 17, 40, 3, 60], seed=9) + [sync.prompt_ids(c, chat=True) for c in CHATS]
    budgets = [5 + (i * 7) % 11 for i in range(6)] + [24] * len(CHATS)
    params = [SamplingParams(temperature=0.8, seed=21 + i) if i % 3 == 1 else GREEDY for i in range(len(ids))]
    want = [alone(sync, p, m, s) for p, m, s in zip(ids, budgets, params)]
    outs, pattern = {}, [0, 0, 0, 2, 0, 0, 1, 2, 2, 0]
    for overlap in (False, True):
        llm = LLM(engine_dir, "microspec", device="cpu", max_batch=4, max_num_tokens=96, overlap=overlap,
                  depth=2, top_k=3, total_tokens=8)
        sched = llm.scheduler()
        cycle = itertools.cycle(pattern)
        sched.runner.policy.choose = lambda reqs, rows, riders=0: next(cycle)
        n = counted(sched, monkeypatch)
        reqs = [sched.add(p, m, s) for p, m, s in zip(ids, budgets, params)]
        streamed = drive(sched, reqs)
        outs[overlap] = [r.out for r in reqs]
        for r in reqs:
            assert streamed[r.rid] == r.out
            assert r.stats.new_tokens == len(r.out) and r.stats.stop_reason in ("eos", "max_tokens")
            s = r.stats  # each step counted once: a plain one emits a token, a round at least one
            assert s.tree_sizes.get(1, 0) + s.rounds <= len(r.out) - 1 <= s.tree_sizes.get(1, 0) + s.round_tokens
        plain = sum(rec.tree == 1 for rec in sched.history if rec.decodes and not rec.chunks)
        if overlap:  # every plain decode-only step overlapped; rounds and prompt steps synchronous
            assert n[0] == 0 and n[1] == plain >= 10 and n[2] >= 10, n
        else:
            assert n[:2] == [0, 0]
        assert sum(r.stats.rounds for r in reqs) >= 10
        sched.step()
        check_pool(sched)
        assert sched.pending is None
    assert any(w[-1] in sync.target.cfg.eos_ids for w in want[-len(CHATS):])  # an EOS finish
    assert outs[True] == outs[False] == want


def test_overlap_phase_times_count_each_step_once(over, monkeypatch):
    """A request's prefill_s + decode_s in a stream of overlapped steps is the steps' own time, about its wall time:
    a step is launched before the one ahead of it is read, so launch-to-read spans two steps (on the H100 an AR
    answer's decode_s came to 1.8x its wall time). Here a device that runs each step for 120 ms after its launch, in
    order (an event that waits for it), as a GPU does: longer than the CPU's own pass (~60 ms), so the device bounds
    the steps, as it does on a GPU."""
    import time

    STEP = 0.12
    sched = over.scheduler()
    launch, busy_until = sched.runner.step_async, [0.0]

    class Device:  # the step's end on a device that runs one step at a time, in launch order
        def __init__(self):
            self.done = busy_until[0] = max(time.perf_counter(), busy_until[0]) + STEP

        def synchronize(self):
            time.sleep(max(0.0, self.done - time.perf_counter()))

    def on_device(chunks, decodes):
        rows, tokens, _ = launch(chunks, decodes)
        return rows, tokens, Device()
    monkeypatch.setattr(sched.runner, "step_async", on_device)
    req = sched.add(prompts(1, [20], seed=3)[0], 8)
    t0 = time.perf_counter()
    drive(sched, [req])
    wall = time.perf_counter() - t0
    spent = req.stats.prefill_s + req.stats.decode_s
    assert len(req.out) == 8 and wall > 8 * STEP
    assert 0.8 * 8 * STEP < spent <= 1.1 * wall, (spent, wall)  # launch to read: ~1.5x the wall time here
    sched.step()
    check_pool(sched)
