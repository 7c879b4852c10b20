"""The speculation policy (engine/policy.py) on the CPU in fp32 with SmolLM2-135M: it picks plain decoding when the
(mocked) step costs say speculation costs more than it returns and the full tree when it pays; whatever it picks,
every step shape (plain rows, each tree) gives AR's tokens, padding rows included; a request's MicroSpec window
and draft state carry on through the steps where it is not speculated."""
from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest

import torch

from trtllm_microspec import LLM
from trtllm_microspec.engine.spec_runner import LAG
from trtllm_microspec.speculative.batch_tree import physical
from trtllm_microspec.engine.policy import PAYS_MARGIN, SpecPolicy, StepCosts, prior_tokens, tree_shapes
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.speculative.tree import TreeConfig

SPEC = dict(depth=2, top_k=3, total_tokens=8, w_max=64, k_pre=2, k_ver=2)
# (prompt, chat, max_new_tokens)
CASES = [("def fibonacci(n):", False, 12), ("What is the capital of France? The capital of France is", False, 14),
         ("The sea is blue and wide, and the ships sail on it to the far away lands where", False, 10)]


@pytest.fixture(scope="module")
def alone(engine_dir):
    ar = LLM(engine_dir, "ar", device="cpu", max_batch=4)
    return [ar.generate(p, m, chat=c).token_ids for p, c, m in CASES]


def requests(*ratios):
    return [SimpleNamespace(accept_ratio=r) for r in ratios]


def test_shapes():
    tree = TreeConfig(depth=5, top_k=10, total_tokens=60)
    assert tree_shapes(tree, "fixed") == [None, tree]
    shapes = tree_shapes(tree, "auto")
    assert shapes[0] is None and shapes[-1] == tree and [t.total_tokens for t in shapes[1:]] == [4, 16, 60]
    assert [t.total_tokens for t in tree_shapes(TreeConfig(2, 3, 8), "auto")[1:]] == [4, 8]
    assert prior_tokens(None) == 1 < prior_tokens(shapes[1]) < prior_tokens(shapes[2]) < prior_tokens(tree)


def test_policy_picks_what_pays():
    """Goodput = the requests' expected tokens / the step's cost: plain when a tree costs more than it returns,
    the full tree when it pays, plain again for requests that stop accepting."""
    shapes = tree_shapes(TreeConfig(2, 3, 8), "auto")
    cost = {0: 1.0, 1: 1.0, 2: 1.0}
    policy = SpecPolicy(shapes, "auto", StepCosts(lambda s, rows: cost[s]))
    assert policy.choose(requests(None, None), 2) == 2  # as cheap as plain: the biggest tree returns the most
    assert policy.why is None
    cost.update({1: 10.0, 2: 10.0})
    policy = SpecPolicy(shapes, "auto", StepCosts(lambda s, rows: cost[s]))
    assert policy.choose(requests(None, None), 2) == 0  # 10x a plain step for < 3 tokens: plain
    assert policy.why == "cost"  # even at the prior acceptance
    cost.update({1: 1.5, 2: 1.6})
    policy = SpecPolicy(shapes, "auto", StepCosts(lambda s, rows: cost[s]))
    reqs = requests(None, None)
    assert policy.choose(reqs, 2) == 2
    # one of the two decoding as AR's (a rider: one token whatever the shape): the other's tokens alone must pay
    assert policy.choose(reqs[:1], 2, riders=1) == 0 and policy.why == "cost"
    for _ in range(20):  # rounds that accept nothing (1 token each): speculation no longer pays
        policy.observe(reqs, 2, 2, [1, 1], 1.6)
    assert all(r.accept_ratio < 0.05 for r in reqs) and policy.choose(reqs, 2) == 0
    assert policy.why == "acceptance"  # the tree would pay at the prior: what it accepted keeps it plain
    assert policy.choose(requests(None), 1) == 0  # a new request starts from the batch's (now low) acceptance
    fixed = SpecPolicy(tree_shapes(TreeConfig(2, 3, 8), "fixed"), "fixed", StepCosts(lambda s, rows: 1 / 0))
    assert fixed.choose(reqs, 2) == 1  # fixed: the configured tree, no cost asked
    assert fixed.pays(256, 256)


def test_a_joining_request_speculates_where_a_tree_pays_by_the_margin():
    """`pays` (whether a joining request speculates for its whole life) asks PAYS_MARGIN more of a tree than a
    step's choice does: a tree expected to return 1.1x plain's tokens per second is chosen for a step, not joined."""
    shapes = tree_shapes(TreeConfig(2, 3, 8), "auto")
    g = prior_tokens(shapes[2])
    for gain, pays in ((1.1, False), (PAYS_MARGIN * 1.02, True)):
        policy = SpecPolicy(shapes, "auto", StepCosts(lambda s, rows: {0: 1.0, 1: 100.0, 2: g / gain}[s]))
        assert policy.choose(requests(None), 1) == 2 and policy.pays(1, 1) is pays


def test_plain_steps_probe_speculation_again():
    """Acceptance is only seen on speculative rounds: after it fell below the break-even, plain steps move the
    ratios back toward the prior until a tree is tried again; if it still accepts little the policy returns to
    plain, if the text turned predictable it keeps the tree."""
    shapes = tree_shapes(TreeConfig(2, 3, 8), "auto")
    policy = SpecPolicy(shapes, "auto", StepCosts(lambda s, rows: {0: 1.0, 1: 1.5, 2: 1.6}[s]))
    reqs = requests(None)
    for _ in range(20):
        policy.observe(reqs, 2, 1, [1], 1.6)  # rounds that accept nothing
    assert policy.choose(reqs, 1) == 0
    plain = 0
    while policy.choose(reqs, 1) == 0:
        policy.observe(reqs, 0, 1, [1], 1.0)
        plain += 1
        assert plain < 200, "plain steps never probe a tree again"
    assert plain >= 5  # not at once: a probe costs a round
    probe = policy.choose(reqs, 1)
    policy.observe(reqs, probe, 1, [1], 1.6)  # the probe still accepts nothing
    assert policy.choose(reqs, 1) == 0
    for _ in range(200):  # ... until the text turns predictable: probed rounds accept the whole tree
        shape = policy.choose(reqs, 1)
        policy.observe(reqs, shape, 1, [1 + (shapes[shape].depth + 1 if shapes[shape] else 0)], 1.0)
    assert policy.choose(reqs, 1) == 2 and policy.choose(requests(None), 1) == 2  # the batch's ratio too


def test_costs_follow_the_engine():
    """A step's measured time corrects its own shape at its rows bucket, and no other bucket; a tree that has not
    run at that bucket yet is corrected as the plain shape there (a tree's own steps then count alone: the
    calibration is not equally wrong for every shape), so a plain cost from its steps is never weighed against a
    bare calibration of a tree."""
    costs = StepCosts(lambda s, rows: {0: 1.0, 1: 2.0}[s] * rows)
    assert costs(1, 4) == 8.0
    costs.observe(0, 4, 8.0)  # plain steps at 4 rows run 2x what was calibrated
    assert costs(0, 4) == 8.0 and costs(1, 4) == 16.0 and costs(0, 2) == 2.0 and costs(1, 2) == 4.0
    costs.observe(1, 4, 24.0)  # and rounds 3x
    assert costs(1, 4) == 24.0 and costs(0, 4) == 8.0
    costs.observe(1, 4, 8.0)  # a running average
    assert costs(1, 4) == pytest.approx(24.0 + 0.2 * (8.0 - 24.0))


def test_rounds_that_overrun_their_calibration_stop():
    """Rounds that run 2.5x their padding-row calibration while plain steps run as calibrated: once the rounds'
    own times are in, the policy decodes plainly. With one drift for every shape (before) plain steps inherited the
    rounds' overrun and the rounds went on."""
    shapes = tree_shapes(TreeConfig(5, 10, 60), "auto")  # plain, 4, 16, 60 tokens
    policy = SpecPolicy(shapes, "auto", StepCosts(lambda s, rows: [1.0, 1.5, 2.5, 4.0][s]))
    reqs = requests(*[None] * 8)
    first = policy.choose(reqs, 8)
    assert first > 0  # at the prior acceptance a round pays on the calibration
    for _ in range(30):  # every round runs 2.5x its calibration and accepts what the prior said
        shape = policy.choose(reqs, 8)
        if shape == 0:
            break
        policy.observe(reqs, shape, 8, [round(policy.prior[shape])] * len(reqs), 2.5 * [1.0, 1.5, 2.5, 4.0][shape])
    assert policy.choose(reqs, 8) == 0 and policy.why == "cost"


def test_a_first_use_is_no_cost():
    """A step that ran a graph's first use (an eager run, then a capture: 18-60 ms on the H200 where a round is ~4)
    corrects no cost, else the shape would look 5-15x dearer and go unused; its tokens still count."""
    shapes = tree_shapes(TreeConfig(2, 3, 8), "auto")
    policy = SpecPolicy(shapes, "auto", StepCosts(lambda s, rows: 1.0))
    reqs = requests(None)
    policy.observe(reqs, 2, 1, [1], None)  # the round accepted nothing, in a first use
    assert policy.costs.drift == {} and policy.costs(2, 1) == 1.0 and reqs[0].accept_ratio < 1.0
    policy.observe(reqs, 2, 1, [1], 3.0)
    assert policy.costs(2, 1) == 3.0


def test_first_uses_are_not_timed(engine_dir, random_draft_dir):
    """The runner hands the policy a step's time only where the step replayed its graph (or ran without graphs,
    as on the CPU): with every launch a first use, the policy's costs stay as calibrated."""
    llm = LLM(engine_dir, "microspec", draft=random_draft_dir, device="cpu", max_batch=2, **SPEC)
    runner = llm.scheduler().runner
    runner.policy.costs = StepCosts(lambda s, rows: 1.0)
    runner.policy.choose = lambda reqs, rows, riders=0: 2  # the full tree every step
    runner.replays = lambda key: False
    llm.generate([CASES[0][0]], [CASES[0][2]])
    assert runner.policy.costs.drift == {}
    del runner.replays  # the CPU's steps are their own (no graphs): timed
    llm.generate([CASES[0][0]], [CASES[0][2]])
    assert set(runner.policy.costs.drift) == {(2, 1)}
    # what the bench reports of the policy at a level (LLM.step_costs): the runner's own estimates
    table = llm.step_costs(1)
    assert [c["tokens"] for c in table] == [1, 4, 8] and table[2]["seconds"] == runner.policy.costs(2, 1)
    assert LLM(engine_dir, "microspec", draft=random_draft_dir, device="cpu", spec_policy="fixed",
               **SPEC).step_costs(1) is None  # nothing to weigh (and no engine made yet)


def test_overlapped_plain_steps_are_timed(engine_dir, random_draft_dir):
    """Plain decode-only steps overlap the host (Scheduler overlap), so their time is known only when their tokens
    are read, a step later: each one's time reaches the plain shape's cost (else it stays as calibrated, which
    reads low), and the time between two requests, when the device had nothing to run, is no step's."""
    llm = LLM(engine_dir, "microspec", draft=random_draft_dir, device="cpu", max_batch=2, **SPEC)
    runner = llm.scheduler().runner
    assert llm.scheduler().overlap
    runner.policy.costs = costs = StepCosts(lambda s, rows: 1.0 if s == 0 else 10.0)  # every step plain
    seen = []
    observe = costs.observe
    costs.observe = lambda shape, rows, seconds: (seen.append((shape, rows, seconds)), observe(shape, rows, seconds))
    idle = 3.0
    runs = []
    for _ in range(2):
        runs.append(llm.generate([CASES[0][0]], [CASES[0][2]])[0])
        time.sleep(idle)
    for r in runs:
        assert r.stats["plain_steps"] == r.stats["new_tokens"] - 1 == CASES[0][2] - 1 and r.stats["rounds"] == 0
    # every decode step of both requests timed (the last one's dropped row too: a step ran), and as a plain step
    assert len(seen) >= 2 * (CASES[0][2] - 1)
    assert {(shape, rows) for shape, rows, _ in seen} == {(0, 1)}
    # the second request's first step is not timed from the first request's end
    assert all(0 < seconds < idle for _, _, seconds in seen), [round(x, 3) for _, _, x in seen]
    assert costs(0, 1) != 1.0  # the calibration corrected


@pytest.mark.parametrize("method", ["eagle", "microspec"])
def test_every_shape_equals_ar(method, engine_dir, random_draft_dir, alone):
    """3 requests in 4 batch slots (a padding row every step), the policy made to cycle through plain rows and
    every tree it may pick: each request gets AR's tokens."""
    llm = LLM(engine_dir, method, draft=random_draft_dir, device="cpu", max_batch=4, **SPEC)
    runner = llm.scheduler().runner
    assert [t and t.total_tokens for t in runner.shapes] == [None, 4, 8]
    cycle = itertools.cycle(range(len(runner.shapes)))
    runner.policy.choose = lambda reqs, rows, riders=0: next(cycle)
    results = llm.generate([p for p, _, _ in CASES], [m for _, _, m in CASES])
    assert [r.token_ids for r in results] == alone
    assert set(results[0].stats["tree_sizes"]) == {1, 4, 8}, results[0].stats  # the longest ran every shape


@pytest.mark.parametrize("expensive", [True, False])
def test_mocked_costs(expensive, engine_dir, random_draft_dir, alone):
    """Speculation 10x a plain step: every step is plain (no round); as cheap as a plain step: every step runs
    the full tree. AR's tokens either way."""
    llm = LLM(engine_dir, "microspec", draft=random_draft_dir, device="cpu", max_batch=2, **SPEC)
    runner = llm.scheduler().runner
    runner.policy.costs = StepCosts(lambda s, rows: 1.0 if s == 0 else 10.0 if expensive else 1.0)
    runner.policy.costs.observe = lambda *a: None  # the mocked costs stay as they are
    results = llm.generate([CASES[0][0], CASES[2][0]], [CASES[0][2], CASES[2][2]])
    assert [r.token_ids for r in results] == [alone[0], alone[2]]
    for r in results:
        s = r.stats
        sizes = s["tree_sizes"]
        assert set(sizes) == ({1} if expensive else {8}), sizes
        assert (s["rounds"] == 0) == expensive
        # every plain step counted, with why; the round statistics only over rounds (None: none ran)
        assert s["plain_steps"] == sizes.get(1, 0) == (s["new_tokens"] - 1 if expensive else 0)
        assert s["plain_reasons"] == ({"cost": s["plain_steps"]} if expensive else {})
        if expensive:
            assert s["acceptance_length"] is s["vocab_mean"] is s["vocab_max"] is s["coverage"] is None
        else:
            assert s["acceptance_length"] >= 1 and s["vocab_mean"] == 64
    steps = [rec.tree for rec in llm.scheduler().history if rec.decodes]
    assert set(steps) == ({1} if expensive else {8})


def test_window_survives_plain_steps(engine_dir, alone):
    """The shipped head with a window that evicts nothing (w_max 4096), the policy alternating plain steps and
    full rounds: a plain step leaves the request's window as it is and keeps its verified top-K ids for the next
    round, after which the window holds every token emitted so far (plain steps' included) beside every id it
    held; the rounds after plain steps still accept drafted tokens (the draft's hidden and KV carried on), with
    AR's tokens."""
    llm = LLM(engine_dir, "microspec", device="cpu", max_batch=2, **{**SPEC, "w_max": 4096})
    sched = llm.scheduler()
    runner = sched.runner
    cycle = itertools.cycle([0, 2])
    runner.policy.choose = lambda reqs, rows, riders=0: next(cycle)
    req = sched.add(llm.prompt_ids(CASES[0][0]), 24)
    v = runner.vocab

    def window(slot):
        return set(v.id_of[slot, :v.R][v.id_of[slot, :v.R] >= 0].tolist())

    plain_steps = rounds = 0
    while not req.done:
        before = window(req.slot) if req.slot >= 0 and not req.prefilling else None
        slot = req.slot
        sched.step()
        if before is None or req.done:
            continue
        after = window(slot)
        if sched.history[-1].tree == 1:
            assert after == before, "a plain step changed the window"
            lag = runner.lags[slot]  # its verified ids wait in the lag buffer
            assert lag >= 1 and (runner.lag_ver[slot, :lag] >= 0).all()
            plain_steps += 1
        else:
            assert before <= after and set(req.out) <= after, "a round lost the plain steps' ids"
            assert (v.pending[slot] == -1).all()
            rounds += 1
    assert plain_steps >= 3 and rounds >= 3
    assert req.out == LLM(engine_dir, "ar", device="cpu").generate(CASES[0][0], 24).token_ids
    assert req.stats.rounds >= 3 and req.stats.round_tokens > req.stats.rounds  # drafts still accepted


def test_bad_policy(engine_dir, capsys):
    with pytest.raises(UserError, match="unknown spec_policy 'sometimes'"):
        LLM(engine_dir, "microspec", device="cpu", spec_policy="sometimes")
    from trtllm_microspec.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "--engine", str(engine_dir), "--prompt", "hi", "--spec-policy", "sometimes"])
    assert e.value.code == 2 and "microspec: error:" in capsys.readouterr().err


def test_sampled_equals_ar_for_every_shape(engine_dir, random_draft_dir):
    """Sampling: a token's uniform is a hash of its request's seed and its position (speculative/sampling.py), so with
    one seed every tree shape -- the policy cycling through them, beside greedy and other sampled requests, with padding
    rows -- emits AR's sampled tokens alone, token for token."""
    ar = LLM(engine_dir, "ar", device="cpu", max_batch=4)
    knobs = [dict(temperature=0.9, seed=11), dict(temperature=1.3, top_k=20, seed=12), {}]
    want = [ar.generate(p, m, **s).token_ids for (p, _, m), s in zip(CASES, knobs)]
    assert want[0] != ar.generate(CASES[0][0], CASES[0][2], temperature=0.9, seed=13).token_ids  # the seed counts
    llm = LLM(engine_dir, "microspec", draft=random_draft_dir, device="cpu", max_batch=4, **SPEC)
    sched = llm.scheduler()
    cycle = itertools.cycle(range(len(sched.runner.shapes)))
    sched.runner.policy.choose = lambda reqs, rows, riders=0: next(cycle)
    from trtllm_microspec.speculative.sampling import SamplingParams
    reqs = [sched.add(llm.prompt_ids(p), m, SamplingParams(**s)) for (p, _, m), s in zip(CASES, knobs)]
    sched.run(reqs)
    assert [r.out for r in reqs] == want
    assert llm.generate(CASES[1][0], CASES[1][2], **knobs[1]).token_ids == want[1]  # alone, one request


def test_lazy_draft_state_equals_per_step(engine_dir):
    """Plain steps leave the draft alone (SpecRunner's lag buffer) and a round first catches it up in one causal
    pass: after 5 plain steps then a round, and 20 (past the buffer's 10 rows: a plain step catches up the full
    buffer; a request joining on the way makes a step with its prompt chunk beside the plain decode row, whose
    draft row joins the lag buffer as a decode-only plain step's) then a round, the draft's KV at every committed
    position and its h_last are those of a runner that catches up after every plain step (lag_max 1: each plain
    step's catch-up row alone, as the per-step path ran it), to fp32 rounding (a GEMM of L rows vs one: ~1e-6); both
    give AR's tokens, the rounds accept the same and leave the same MicroSpec window."""
    schedule = [0] * 5 + [2] + [0] * 20 + [2] * 3
    runs = []
    for lazy in (True, False):
        llm = LLM(engine_dir, "microspec", device="cpu", max_batch=2, **SPEC)
        sched = llm.scheduler()
        runner = sched.runner
        lag_max = runner.lag_max
        assert lag_max == min(LAG, runner.reserve) == 10  # this tree's reserve
        if not lazy:
            runner.lag_max = 1
        steps = list(schedule)
        runner.policy.choose = lambda reqs, rows, riders=0: steps.pop(0)
        req = sched.add(llm.prompt_ids(CASES[0][0]), 200)
        seen, lags, mixed = [], [], []
        while steps and not req.done:
            if len(lags) == 9:  # (the prompt's step, 5 plain, a round) 2 plain steps after the round
                sched.add(llm.prompt_ids(CASES[1][0]), 4)
            before = runner.lags[req.slot]
            sched.step()
            if req.prefilling:
                continue
            lags.append(runner.lags[req.slot])
            if sched.history[-1].chunks and sched.history[-1].decodes:
                mixed.append((before, lags[-1]))
            if sched.history[-1].tree > 1:  # after a round: the committed draft KV and h_last
                cols = physical(runner.table[req.slot:req.slot + 1], torch.arange(req.n)[None])[0]
                c = runner.dcache
                seen.append((req.n, c.k[:, :, cols].clone(), c.v[:, :, cols].clone(), c.pos[cols].clone(),
                             runner.h_last[req.slot].clone(), list(req.out), runner.vocab.id_of[req.slot].clone()))
        assert not steps, "the request ended before the schedule did"
        runs.append((seen, lags))
        # the mixed step's decode row is a plain step: its draft row joins the lag buffer (the per-step runner's
        # full buffer of 1 is caught up first)
        assert mixed == [(2, 3) if lazy else (1, 1)]
    (lazy, lazy_lags), (eager, eager_lags) = runs
    assert max(lazy_lags) == lag_max and max(eager_lags) == 1  # the lazy runner's buffer filled; the other's never
    assert len(lazy) == len(eager) == 4
    for a, b in zip(lazy, eager):
        assert a[0] == b[0] and a[5] == b[5]  # the same tokens, the same acceptance
        assert torch.equal(a[6], b[6])  # the same window: the plain steps' verified ids joined it in order
        for x, y in zip(a[1:5], b[1:5]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)  # fp32 rounding: a pass of L rows vs 1
    ar = LLM(engine_dir, "ar", device="cpu")
    out = lazy[-1][5]
    assert out == ar.generate(CASES[0][0], len(out)).token_ids


def test_round_variants_are_two(engine_dir):
    """Rounds after 1, 3 and 6 plain steps pad their catch-up to the lag buffer's rows: one graph key for a round
    with a catch-up and one without (a key per lag made the `auto` policy meet a new graph every few steps)."""
    llm = LLM(engine_dir, "microspec", device="cpu", max_batch=1, **SPEC)
    sched = llm.scheduler()
    runner = sched.runner
    steps = [0, 2, 2, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 2, 2]
    runner.policy.choose = lambda reqs, rows, riders=0: steps.pop(0)
    keys, launch = [], runner.launch
    runner.launch = lambda key, fn: (keys.append(key), launch(key, fn))
    req = sched.add(llm.prompt_ids(CASES[0][0]), 200)
    while steps and not req.done:
        sched.step()
    assert not steps
    rounds = {k for k in keys if runner.shapes[k[0]] is not None}
    assert {k[-1] for k in rounds} == {0, runner.lag_max}  # a round without pending rows, and with them padded
    assert len({(k[0], k[1], k[2], k[4]) for k in rounds}) == 1  # (S, the KV span, is exact off CUDA graphs)


@pytest.mark.parametrize("queued", [False, True])
def test_requests_decode_as_ar_where_no_tree_pays(queued, engine_dir, alone):
    """Calibrated costs by which a tree pays for one request and not for two: a prompt that joins alone
    speculates (its pass computes its top-K_pre: prompt_rows holds its ids, then the target's top ids at each row;
    it runs rounds); one with a second request queued behind it (the token budget holds one prompt a step) joins a
    batch of two, where no tree pays: both decode as AR's to their ends -- only AR's passes launched (its graph
    keys), no prompt row written, no round, no lag -- with AR's tokens, and the statistics say so."""
    p, chat, m = CASES[2]
    llm = LLM(engine_dir, "microspec", device="cpu", max_batch=2, max_num_tokens=16, **SPEC)
    sched = llm.scheduler()
    runner = sched.runner
    runner.policy.costs = StepCosts(lambda s, rows: 1.0 if s == 0 or rows == 1 else 10.0)
    runner.policy.costs.observe = lambda *a: None  # the mocked costs stay as they are
    runner.calibrate()
    assert runner.calibrated and runner.policy.pays(1, 1) and not runner.policy.pays(2, 2)
    keys, launch = [], runner.launch
    runner.launch = lambda key, fn: (keys.append(key), launch(key, fn))
    reqs = [sched.add(llm.prompt_ids(p), m) for _ in range(2 if queued else 1)]
    first = reqs[0]
    assert len(first.prompt) > 16  # two passes: the second request waits behind the first
    while first.prefilling:
        sched.step()
    cols = physical(runner.table[first.slot:first.slot + 1], torch.arange(len(first.prompt))[None])[0]
    rows = runner.prompt_rows[cols]
    if queued:  # AR's passes: nothing of the draft's
        assert (rows == -1).all()
    else:
        assert rows[:, 0].tolist() == first.prompt and (rows[:, 1:] >= 0).all()
    sched.run(reqs)
    assert all(r.out == alone[2] for r in reqs)
    for r in reqs:
        s = r.stats.summary()
        assert s["speculative"] is (not queued)  # the statistics say whether it speculated
        assert (s["rounds"] == 0 and set(s["tree_sizes"]) == {1} and s["plain_reasons"] == {"cost": s["plain_steps"]}
                and s["plain_steps"] == len(r.out) - 1) if queued else s["rounds"] > 0
    spec_keys = [k for k in keys if k[0] == "spec-packed" or len(k) == 6]  # the speculative runner's own passes
    assert not spec_keys if queued else spec_keys
    assert max(runner.lags) == 0 or not queued


def test_request_as_ar_beside_one_that_speculates(engine_dir):
    """The same costs: a request running alone speculates; a second one joining its batch (of two: no tree pays)
    decodes as AR's. While both run every step is plain (one shape a step), the first one's rows going to its lag
    buffer, the second's to none; once the second is done the first's rounds resume after a catch-up. Both emit
    AR's tokens."""
    p = CASES[0][0]
    want = LLM(engine_dir, "ar", device="cpu").generate(p, 40).token_ids
    assert len(want) == 40  # no EOS: a runs on after b is done
    llm = LLM(engine_dir, "microspec", device="cpu", max_batch=2, **SPEC)
    sched = llm.scheduler()
    runner = sched.runner
    runner.policy.costs = StepCosts(lambda s, rows: 1.0 if s == 0 or rows == 1 else 10.0)
    runner.policy.costs.observe = lambda *a: None  # the mocked costs stay as they are
    runner.calibrate()
    a = sched.add(llm.prompt_ids(p), 40)
    while a.stats.rounds < 1:
        sched.step()
    b = sched.add(llm.prompt_ids(p), 6)
    lags = []
    while not b.done:
        sched.step()
        lags.append((runner.lags[a.slot], runner.lags[b.slot]))
    rounds = a.stats.rounds
    sched.run([a, b])
    assert a.out == want and b.out == want[:6]
    assert a.stats.speculative is True and b.stats.speculative is False
    assert b.stats.rounds == 0 and set(b.stats.tree_sizes) == {1}
    assert max(x for x, _ in lags) > 0 and all(y == 0 for _, y in lags)  # a's plain rows pend, b's never
    assert a.stats.rounds > rounds and a.stats.plain_reasons.get("cost", 0) >= 5  # rounds again once b is done


def test_step_costs_table_says_what_the_policy_weighed():
    """SpecPolicy.table: per shape its tokens, prior tokens a round and the estimated step seconds where measured
    (calibrated, corrected by the steps run); the bench's note puts them in one line with tokens per ms."""
    from trtllm_microspec.bench.specbench import step_costs_note

    tree = TreeConfig(depth=5, top_k=10, total_tokens=60)
    shapes = tree_shapes(tree, "auto")
    policy = SpecPolicy(shapes, "auto", StepCosts(lambda s, rows: [0.002, 0.003, 0.004, 0.009][s]))
    before = policy.table(16)
    assert [c["tokens"] for c in before] == [1, 4, 16, 60] and all(c["seconds"] is None for c in before)
    assert [c["prior"] for c in before] == [prior_tokens(t) for t in shapes]
    policy.best(16, 16, 16)  # weighs every shape at the bucket: measured now
    policy.costs.observe(3, 16, 0.018)  # the 60-token tree ran at twice its calibration
    after = policy.table(16)
    assert [c["seconds"] for c in after] == pytest.approx([0.002, 0.003, 0.004, 0.018])
    assert all(c["seconds"] is None for c in policy.table(64))  # another bucket: nothing measured there
    note = step_costs_note("microspec at concurrency 16", after)
    assert note.startswith("microspec at concurrency 16: the policy's step costs")
    assert "plain 2.00 ms for 1.00 tokens = 0.50 tokens/ms" in note and "60-token tree 18.00 ms" in note


def test_a_request_that_asks_not_to_speculate_rides_the_rounds(engine_dir, alone):
    """SamplingParams(speculate=False): the request decodes as AR's -- no round of its own, every step of it a plain
    one the request asked for -- while the requests beside it run their rounds (`fixed`: every step a tree), in
    which it rides along (its tree verified, none of it taken). Every request emits AR's tokens; its draft KV, never
    written (NaN here), touches no other request's."""
    from trtllm_microspec.speculative.sampling import SamplingParams

    llm = LLM(engine_dir, "microspec", device="cpu", max_batch=4, spec_policy="fixed", **SPEC)
    sched = llm.scheduler()
    runner = sched.runner
    runner.dcache.k.fill_(float("nan"))
    runner.dcache.v.fill_(float("nan"))
    rounds, launch = [], runner.launch
    runner.launch = lambda key, fn: (rounds.append(len(sched.running)) if len(key) == 6 and key[0] == 1 else None,
                                     launch(key, fn))
    reqs = [sched.add(llm.prompt_ids(p, c), m, SamplingParams(speculate=i != 1)) for i, (p, c, m) in enumerate(CASES)]
    sched.run(reqs)
    assert [r.out for r in reqs] == alone
    off = reqs[1].stats.summary()
    assert off["speculative"] is False and off["rounds"] == 0 and set(off["tree_sizes"]) == {1}
    assert off["plain_reasons"] == {"request": off["plain_steps"]} and off["plain_steps"] == len(reqs[1].out) - 1
    assert all(r.stats.speculative and r.stats.rounds > 0 for r in (reqs[0], reqs[2]))
    assert max(rounds) == 3  # rounds ran with all three in the batch: the one that asked not to rode them
    with pytest.raises(UserError, match="speculate must be true or false, got 'no'"):
        SamplingParams(speculate="no")


def test_a_rider_takes_one_token_a_round_whatever_its_draft(engine_dir):
    """The round takes none of a rider's tree even where its draft would be right: a request that speculated (its
    draft state good, a round of it took more than one token) made to decode as AR's mid-way emits one token a step
    from then on, AR's, while the request beside it goes on with its rounds."""
    prompts = [CASES[0][0]] * 2
    want = [LLM(engine_dir, "ar", device="cpu").generate(prompts[0], 40).token_ids] * 2
    assert len(want[0]) == 40  # no EOS: b runs as long as a
    llm = LLM(engine_dir, "microspec", device="cpu", max_batch=4, spec_policy="fixed", **SPEC)
    sched = llm.scheduler()
    runner = sched.runner
    a, b = reqs = [sched.add(llm.prompt_ids(p), 40) for p in prompts]
    while max((n for _, n in a.emits), default=0) < 2:
        sched.step()
    assert len(a.out) < 30
    a.stats.speculative = False
    runner.rides[a.slot] = True
    before, rounds = len(a.emits), b.stats.rounds
    sched.run(reqs)
    assert [r.out for r in reqs] == want
    assert all(n == 1 for _, n in a.emits[before:]) and len(a.emits) - before >= 10
    assert b.stats.rounds >= rounds + 10  # a rode b's rounds


def test_joins_of_a_step_ask_the_policy_once(engine_dir):
    """Whether the requests joining in one step speculate is one answer (the batch they join is the same for each:
    under --tp each answer is a broadcast): three joining together ask policy.pays once; one joining later asks
    again, and its answer is its own batch's (the mocked costs: a tree pays for one request, not for more)."""
    llm = LLM(engine_dir, "microspec", device="cpu", max_batch=4, **SPEC)
    sched = llm.scheduler()
    runner = sched.runner
    runner.policy.costs = StepCosts(lambda s, rows: 1.0 if s == 0 or rows == 1 else 10.0)
    runner.calibrate()
    asked, pays = [], runner.policy.pays
    runner.policy.pays = lambda n, rows: (asked.append(n), pays(n, rows))[1]
    p, c, m = CASES[0]
    reqs = [sched.add(llm.prompt_ids(p, c), m) for _ in range(3)]
    sched.step()
    assert all(r.slot >= 0 for r in reqs) and asked == [3]
    assert [r.stats.speculative for r in reqs] == [False] * 3
    sched.run(reqs)
    late = sched.add(llm.prompt_ids(p, c), m)
    sched.run([late])
    assert asked == [3, 1] and late.stats.speculative is True
