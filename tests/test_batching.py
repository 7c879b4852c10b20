"""In-flight batching (engine/scheduler.py, runner.py, block_manager.py) on the CPU in fp32: every request of a
mixed batch gets exactly the tokens it gets alone, and the pool gets every block back whatever happens."""
from __future__ import annotations

import json

import pytest
import torch

from trtllm_microspec import LLM
from plugins.layers import KV_BLOCK
from trtllm_microspec.engine.block_manager import GIB, BlockManager, block_bytes
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.speculative.sampling import SamplingParams

# (prompt, chat, max_new_tokens): different lengths and budgets; the first stops at EOS after 8 tokens
CASES = [
    ("What is the capital of France?", True, 16),
    ("def fibonacci(n):", False, 12),
    ("Hi", True, 8),
    ("The sea is blue and wide, and the ships sail on it to the far away lands where", False, 10),
]


@pytest.fixture(scope="module")
def ar(engine_dir):
    return LLM(engine_dir, "ar", device="cpu", max_batch=3)


@pytest.fixture(scope="module")
def alone(ar):
    out = [ar.generate(p, m, chat=c).token_ids for p, c, m in CASES]
    assert len(out[0]) < CASES[0][2] and out[0][-1] in ar.target.cfg.eos_ids  # the early-EOS case
    return out


@pytest.mark.parametrize("graphed", [False, True])
def test_ar_batch_equals_alone(ar, alone, monkeypatch, graphed):
    """4 requests over 3 batch slots, one cancelled after 3 tokens: the last joins the running batch then. A
    budget of 24 tokens a step splits the prompts into chunks, and one pass runs the chunks of several requests
    (packed) beside the decode rows of the others: no padding rows, or (graphed) as a CUDA graph replays it, padded
    to its rows bucket, every index in the bucket's buffer."""
    sched = ar.scheduler()
    monkeypatch.setattr(sched.runner, "max_num_tokens", 24)
    monkeypatch.setattr(sched.runner, "graph_rows", 24 if graphed else 0)
    monkeypatch.setattr(sched.runner, "static", {})
    passes, real_pass = [], sched.runner._pass  # (each step's pass, overlapped or not)
    monkeypatch.setattr(sched.runner, "_pass", lambda chunks, decodes: passes.append(
        ([c for _, c in chunks], len(decodes))) or real_pass(chunks, decodes))
    reqs = [sched.add(ar.prompt_ids(p, c), m) for p, c, m in CASES]
    cancel = reqs[1]
    sched.step()
    assert reqs[3] in sched.waiting  # joins once the cancelled one has left
    while not all(r.done for r in reqs):
        for req, toks in sched.step():
            assert req.out[-len(toks):] == toks
        if len(cancel.out) >= 3 and not cancel.done:
            sched.cancel(cancel)
        assert len(sched.running) <= 3
    for i, r in enumerate(reqs):
        if r is cancel:
            assert r.stats.stop_reason == "cancelled" and 3 <= len(r.out) < len(alone[i])
            assert r.out == alone[i][:len(r.out)]
        else:
            assert r.out == alone[i], f"request {i} differs from its run alone"
            assert r.stats.new_tokens == len(r.out) and r.stats.prompt_tokens == len(r.prompt)
    assert reqs[0].stats.stop_reason == "eos" and reqs[2].stats.stop_reason == "max_tokens"
    sched.step()  # the boundary after the last step
    assert sched.idle and sched.blocks.used == 0 and len(sched.runner.free_slots) == 3
    assert max(sum(c) + d for c, d in passes) == 24, passes
    assert any(len(set(c)) > 1 for c, _ in passes)  # chunks of different lengths in one pass
    assert any(c and d for c, d in passes)  # prompt chunks and decode rows in one pass
    assert all(Mb == 128 for Mb, _, _ in sched.runner.static) and bool(sched.runner.static) == graphed


def test_generate_list(ar, alone):
    results = ar.generate([p for p, _, _ in CASES[1:3]], [m for _, _, m in CASES[1:3]], chat=False)
    assert results[0].token_ids == alone[1]
    assert results[0].text == ar.tokenizer.decode(alone[1])
    assert results[1].stats["method"] == "ar" and results[1].stats["ttft_s"] > 0
    assert ar.scheduler().blocks.used == 0


def test_waits_for_blocks(engine_dir, ar, alone):
    """A pool of 3 blocks (2 usable, 64 slots): two requests that grow to 2 blocks cannot run together. Both join
    with one block each; when the first grows into its second block, the second (joined last) is preempted, waits
    in the queue and is recomputed (its prompt and its tokens so far prefilled again) once the first frees its
    blocks: its tokens are still those it gets alone."""
    c = ar.target.cfg
    per_block = block_bytes(c, torch.float32)
    llm = LLM(engine_dir, "ar", device="cpu", max_batch=4, kv_memory=3 * per_block / GIB)
    sched = llm.scheduler()
    assert sched.blocks.num_blocks == 3
    ids = llm.prompt_ids(CASES[1][0])
    budget = 64 - len(ids) - 1  # exactly two blocks
    want = ar.generate(CASES[1][0], budget).token_ids
    assert len(want) == budget  # no EOS: both requests run into their second block
    a, b = sched.add(ids, budget), sched.add(ids, 40)
    waited = False
    while not b.done:
        sched.step()
        waited |= a.slot >= 0 and b in sched.waiting
    assert waited and a.done and b.preemptions >= 1 and b.resumed > 0
    assert a.out == want and b.out == want[:40]
    sched.step()
    assert sched.blocks.used == 0
    with pytest.raises(UserError, match="needs .* cache slots; this engine holds at most 64"):
        sched.add(ids, budget + 1)


def test_error_and_refusals_return_blocks(ar, monkeypatch):
    """A pass with prompt chunks that fails fails the requests of those chunks; the others' decodes run again
    without them and the batch goes on."""
    sched = ar.scheduler()
    ok = sched.add([1, 2, 3], 4)
    sched.step()  # ok's prompt is in; bad comes after
    bad = sched.add([4, 5, 6], 4)
    real = sched.runner._pass  # (each step's pass, overlapped or not)

    def step(chunks, decodes):
        if any(req is bad for req, _ in chunks):
            raise RuntimeError("boom")
        return real(chunks, decodes)

    monkeypatch.setattr(sched.runner, "_pass", step)
    sched.run([ok, bad])
    assert bad.stats.stop_reason == "error" and "boom" in bad.error and len(ok.out) == 4
    with pytest.raises(RuntimeError, match="generation failed: RuntimeError: boom"):
        ar.result(bad)
    sched.step()
    assert sched.blocks.used == 0 and len(sched.runner.free_slots) == 3
    with pytest.raises(UserError, match="the prompt is empty"):
        sched.add([], 4)
    assert not LLM(ar.engine_dir, "naive", device="cpu").scheduler().runner.vocab.use_packed  # ablations batch too


@pytest.mark.parametrize("method", ["ar", "microspec"])
def test_budget_past_max_seq_len_stops_at_length(engine_dir, random_draft_dir, method):
    """A budget larger than the room left runs, and stops alone and batched where there is no room for one more
    step ("length"), with the same tokens; only the prompt has a limit (the same alone and batched)."""
    llm = LLM(engine_dir, method, draft=random_draft_dir, device="cpu", max_seq_len=64, max_batch=2)
    prompt = "The sea is blue and wide, and the ships sail on it"
    alone = llm.generate(prompt, 100)
    batched = llm.generate([prompt, "Hi"], [100, 4])
    assert alone.stats["stop_reason"] == batched[0].stats["stop_reason"] == "length"
    assert batched[0].token_ids == alone.token_ids and batched[1].stats["stop_reason"] == "max_tokens"
    assert llm.scheduler().blocks.used == 0
    with pytest.raises(UserError, match=r"the prompt has \d+ tokens; this engine accepts at most"):
        llm.generate(["Hi", "hello " * 80], 4)


def test_cli_prompts_file(engine_dir, alone, tmp_path, capsys):
    from trtllm_microspec.cli import main

    f = tmp_path / "prompts.txt"
    f.write_text(f"{CASES[1][0]}\n\n{CASES[3][0]}\n")
    main(["generate", "--engine", str(engine_dir), "--device", "cpu", "--prompts-file", str(f), "--max-new-tokens",
          "10", "--max-batch", "2", "--json"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in lines] == [alone[1][:10], alone[3]]
    f.write_text("[1, 2]")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--engine", str(engine_dir), "--device", "cpu", "--prompts-file", str(f)])
    assert e.value.code == 2
    assert "prompt 0 (counting from 0) is a number 1, not a non-empty string" in capsys.readouterr().err


SPEC = dict(depth=2, top_k=3, total_tokens=8, w_max=64, k_pre=2, k_ver=2)


@pytest.mark.parametrize("method,budget", [("eagle", 22), ("microspec", 22), ("microspec", 1),
                                           ("microspec-paper", 22)])
def test_spec_batch_equals_alone(method, budget, engine_dir, random_draft_dir, alone, monkeypatch):
    """Speculative rounds for 3 requests at once over 2 batch slots (one cancelled after its first round), under a
    budget of `budget` rows a step, a round counting its 8 tree rows (22: prompts prefilled 6 tokens a step beside
    two rounds, more beside one; 1, set below the check: a prompt advances one token a step, its last too, while
    no round runs): each request's tokens are AR's; each MicroSpec window ends exactly as the same request's window
    alone (so no token of another request ever entered it, and a chunked prefill starts it as a whole one does),
    and so does its fill (`microspec`)."""
    # fixed: every step a round of the configured tree, alone as in the batch (the same rounds)
    llm = LLM(engine_dir, method, draft=random_draft_dir, device="cpu", max_batch=2, spec_policy="fixed", **SPEC)
    sched = llm.scheduler()
    window = method != "eagle"
    cases = [CASES[1], CASES[0], CASES[2]]
    want = [alone[1], alone[0], alone[2]]
    slot_of, final = {}, {}

    def run(reqs, cancel=None):
        """Steps until reqs are done; each request's window as it leaves (a later request resets its slot's)."""
        while not all(r.done for r in reqs):
            slot_of.update({r.rid: r.slot for r in reqs if r.slot >= 0})
            sched.step()
            for r in reqs:
                if r.done and r.rid not in final and window and r is not cancel:
                    v, slot = sched.runner.vocab, slot_of[r.rid]
                    final[r.rid] = (v.ring[slot].clone(), v.id_of[slot, :v.R].clone(), v.fill_id_of[slot].clone())
            if cancel is not None and cancel.out and not cancel.done:
                sched.cancel(cancel)

    solo = []
    for p, c, m in cases[:2]:  # alone, with the whole budget: one prefill pass
        solo.append(sched.add(llm.prompt_ids(p, c), m))
        run(solo[-1:])
        assert solo[-1].out == want[len(solo) - 1]
    monkeypatch.setattr(sched.runner, "max_num_tokens", budget)
    reqs = [sched.add(llm.prompt_ids(p, c), m) for p, c, m in cases]
    cancel = reqs[2]
    run(reqs, cancel)
    for r, w, s in zip(reqs[:2], want, solo):
        assert r.out == w
        assert r.stats.rounds == s.stats.rounds and r.stats.vocab_max > 0  # the same drafts: the same prefill
    assert cancel.stats.stop_reason == "cancelled" and cancel.out == want[2][:len(cancel.out)]
    if window:
        for r, s in zip(reqs[:2], solo):
            assert all(torch.equal(a, b) for a, b in zip(final[r.rid], final[s.rid]))
        ids, fill = final[reqs[0].rid][1:]
        if method == "microspec":  # the window and its fill: W_max ids together, always
            assert (ids >= 0).sum() + (fill >= 0).sum() == ids.numel()
        else:
            assert not (fill >= 0).any()
    sched.step()
    assert sched.blocks.used == 0


# (case, sampling): greedy beside two sampled requests of different knobs, the last one twice (same seed, same tokens)
MIXED = [(CASES[1], {}), (CASES[0], dict(temperature=0.8, top_p=0.9, seed=1)),
         (CASES[3], dict(temperature=1.3, top_k=20, seed=2)), (CASES[3], dict(temperature=1.3, top_k=20, seed=2))]


@pytest.mark.parametrize("method", ["ar", "microspec"])
def test_sampled_batch_equals_alone(method, engine_dir, ar):
    """Greedy and sampled requests in one batch (3 slots, the fourth joins as one leaves): each gets exactly the
    tokens it gets alone with the same SamplingParams and seed (a token's uniform: a hash of the seed and its
    position), and those are AR's."""
    llm = ar if method == "ar" else LLM(engine_dir, method, device="cpu", max_batch=3, spec_policy="fixed",
                                        **SPEC)  # the trained head
    want = [llm.generate(p, m, chat=c, **s).token_ids for (p, c, m), s in MIXED]
    sched = llm.scheduler()
    reqs = [sched.add(llm.prompt_ids(p, c), m, SamplingParams(**s)) for (p, c, m), s in MIXED]
    sched.run(reqs)
    assert [r.out for r in reqs] == want
    if method != "ar":  # AR's sampled tokens themselves
        assert want == [ar.generate(p, m, chat=c, **s).token_ids for (p, c, m), s in MIXED]
    assert want[2] == want[3] and want[2] != llm.generate(CASES[3][0], CASES[3][2], temperature=1.3, top_k=20,
                                                          seed=3).token_ids
    if method != "ar":  # sampled requests walked into the drafted trees, not only the target's own draws
        assert all(r.stats.round_tokens > r.stats.rounds for r in reqs[1:])
    sched.step()
    assert sched.blocks.used == 0


def test_padding_rows(engine_dir, alone):
    """3 requests in 4 batch slots: every round runs 4 rows (the batch-size bucket a CUDA graph is captured for),
    the last a padding row in the padding slot. The requests still get AR's tokens, and the padding rows leave the
    padding slot's MicroSpec window as it starts (its pinned ids only)."""
    llm = LLM(engine_dir, "microspec", device="cpu", max_batch=4, spec_policy="fixed", **SPEC)
    sched = llm.scheduler()
    runner, rows = sched.runner, []
    real_round = runner._round
    v = runner.vocab
    pinned = v.id_of[runner.pad].clone()
    assert (pinned[:len(v.pinned)] == v.pinned).all() and (pinned[len(v.pinned):] == -1).all()

    def spy(shape, Bb, *rest):
        rows.append((Bb, int((runner.inp[2, :Bb] == runner.pad).sum())))
        real_round(shape, Bb, *rest)

    runner._round = spy
    reqs = [sched.add(llm.prompt_ids(p, c), m) for p, c, m in CASES[1:]]
    sched.run(reqs)
    assert [r.out for r in reqs] == alone[1:]
    assert rows[0] == (4, 1)
    assert (v.ring[runner.pad] == -1).all() and (v.id_of[runner.pad] == pinned).all()


def test_sampled_batch_bf16(engine_dir):
    """bf16 weights, sampled, alone and batched: the draft's hidden / temperature (fp32 knobs) meets the bf16 head
    rows."""
    llm = LLM(engine_dir, "microspec", device="cpu", dtype="bfloat16", max_batch=2, spec_policy="fixed", **SPEC)
    assert llm.generate(CASES[1][0], 6, temperature=0.8, seed=1).num_new_tokens == 6
    results = llm.generate([CASES[1][0], CASES[3][0]], 6, temperature=0.8, seed=1)
    assert [r.num_new_tokens for r in results] == [6, 6] and all(r.stats["rounds"] > 0 for r in results)


def test_prefix_cache_blocks():
    """The pool's prefix cache alone: a leaving request registers its full blocks; a joining one takes the longest
    registered run that starts its prompt (its last token left out), shared and counted per holder; free blocks are
    handed out unregistered ones first, then registered ones from a run's end; a block handed out again is forgotten
    and so is what followed it."""
    bm = BlockManager(7, 8, prefix_cache=True)  # blocks 1..6
    toks = list(range(100))
    assert bm.match(1, toks) == [] and bm.grow(1, 100) == [1, 2, 3, 4]
    bm.release(1, toks[:99])  # 99 tokens in its cache: 3 full blocks
    assert len(bm.cached) == 3 and bm.used == 0
    assert bm.match(2, toks[:97]) == [1, 2, 3]  # 96 tokens cached, the 97th to compute
    assert bm.match(3, toks[:96]) == [1, 2]  # its last token is computed: the third block is not taken
    assert bm.match(4, toks[:40] + [7] * 40) == [1]
    assert bm.refs[1:5] == [3, 2, 1, 0] and bm.used == 3
    for rid in (2, 3, 4):
        bm.release(rid, None)
    assert bm.used == 0 and bm.grow(5, 64) == [4, 5]  # unregistered blocks first
    assert bm.grow(5, 5 * 32) == [6, 3, 2]  # then registered ones, a run's end first: 3 and 2 forgotten
    assert len(bm.cached) == 1 and bm.match(6, toks) == [1]
    bm.release(6, None)
    bm.release(5, list(range(1000, 1160)))  # blocks 4, 5, 6, 3, 2 under other tokens
    assert bm.match(7, list(range(1000, 1100))) == [4, 5, 6] and bm.match(8, toks) == [1]


def run_to_end(sched, *prompts: list[int]) -> list:
    """Requests of `prompts` (24 new tokens each) stepped to their end, and the boundary after their last step:
    their blocks are back."""
    reqs = [sched.add(p, 24) for p in prompts]
    sched.run(reqs)
    sched.step()
    return reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_cache_next_turn(engine_dir, overlap):
    """A conversation's next turn prefills only its new turn: its history's full blocks come from the blocks the
    first turn left; two requests sharing that prompt share its blocks while they run; a small pool hands the cached
    blocks out again and a later request then computes its prompt. Every output is that of the same request on an
    engine with no prefix cache (and the pool gets every block back)."""
    c = LLM(engine_dir, "ar", device="cpu", max_batch=4, overlap=overlap)
    plain = LLM(engine_dir, "ar", device="cpu", max_batch=4, overlap=overlap, prefix_cache=False)
    sched, ref = c.scheduler(), plain.scheduler()
    run = run_to_end
    first = c.prompt_ids(CASES[0][0] + " Answer in one long sentence about its history.", True)
    a, = run(sched, first)
    again = first + a.out + c.tokenizer.encode("\nAnd of Italy? " * 4)
    b, d = run(sched, again, again)  # both take the first turn's blocks at once
    fed = len(first) + len(a.out) - 1  # the first turn's last token was never fed back
    assert b.stats.cached_tokens == d.stats.cached_tokens == fed // KV_BLOCK * KV_BLOCK > 0
    assert [b.out, d.out] == [r.out for r in run(ref, again, again)]
    assert a.out == run(ref, first)[0].out and sched.blocks.used == 0
    assert len(sched.blocks.cached) >= len(again) // KV_BLOCK - 1
    # every free block taken: the cached ones are handed out (forgotten), and `again` is computed in full
    sched.blocks.grow(-1, KV_BLOCK * len(sched.blocks.free))
    sched.blocks.release(-1)
    e, = run(sched, again)
    assert e.stats.cached_tokens == 0 and e.out == b.out and sched.blocks.used == 0


def test_prefix_cache_for_requests_that_decode_as_ar(engine_dir, random_draft_dir, monkeypatch):
    """A speculative method's request that decodes as AR's (no tree pays at the batch it joins) takes the prefix
    cache's blocks as AR's does, those a speculating request left too; one that speculates prefills its whole prompt
    whatever the cache holds. Every output is AR's (fp32), and the pool gets every block back."""
    from trtllm_microspec.engine.spec_runner import SpecRunner

    ref = LLM(engine_dir, "ar", device="cpu", max_batch=2, prefix_cache=False).scheduler()
    # fixed: a speculating request runs rounds whatever the CPU's timings (auto weighs them)
    llm = LLM(engine_dir, "microspec", draft=random_draft_dir, device="cpu", max_batch=2, spec_policy="fixed", **SPEC)
    sched = llm.scheduler()
    pays = [True]
    monkeypatch.setattr(SpecRunner, "prompts_pay", lambda self: pays[0])
    run = run_to_end
    first = llm.prompt_ids(CASES[0][0] + " Answer in one long sentence about its history.", True)
    a, = run(sched, first)  # speculates: its rounds commit the KV its blocks are registered under
    assert a.stats.speculative is True and a.stats.rounds > 0 and a.stats.cached_tokens == 0
    again = first + a.out + llm.tokenizer.encode("\nAnd of Italy? " * 4)
    want = run(ref, again)[0].out
    b, = run(sched, again)  # speculates too: its whole prompt, though the cache holds its start
    pays[0] = False
    c, d = run(sched, again, again)  # decode as AR's: both start from the cached blocks
    fed = len(first) + len(a.out) - 1  # the first turn's last token was never fed back
    assert b.stats.speculative is True and b.stats.cached_tokens == 0
    assert c.stats.speculative is d.stats.speculative is False
    assert c.stats.cached_tokens == d.stats.cached_tokens >= fed // KV_BLOCK * KV_BLOCK > 0
    assert a.out == run(ref, first)[0].out and b.out == c.out == d.out == want
    assert sched.blocks.used == 0
