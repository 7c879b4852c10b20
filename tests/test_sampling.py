"""Sampling: temperature / top-k / top-p on the target's distribution, seeds, validation, and lossless speculative
sampling -- exactly, by enumeration, on a synthetic tree, and statistically on the real SmolLM2 engine with its
trained EAGLE head. Each losslessness check is shown to fail with a broken acceptance rule."""
from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch

from trtllm_microspec import LLM
from trtllm_microspec.cli import main
from trtllm_microspec.engine import spec_runner
from trtllm_microspec.models.model import Span
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.speculative.batch_tree import accept
from trtllm_microspec.speculative.sampling import Sampler, SamplingParams, target_probs
from trtllm_microspec.speculative.tree import Tree, causal


def probs_of(logits, temperature=1.0, top_k=0, top_p=1.0):
    V = logits.shape[-1]
    return target_probs(logits, torch.tensor(temperature), torch.tensor(top_k or V), torch.tensor(top_p),
                        filtered=bool(top_k) or top_p < 1)


def test_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    assert torch.allclose(probs_of(logits, 0.5), (logits / 0.5).softmax(-1))
    p = probs_of(logits, 1.0, top_k=2)
    assert torch.allclose(p, torch.tensor([[1, 1 / torch.e, 0, 0, 0]]) / (1 + 1 / torch.e))
    full = logits.softmax(-1)[0]  # [0.563, 0.207, 0.126, 0.076, 0.028]
    p = probs_of(logits, 1.0, top_p=0.75)  # 0.563 < 0.75 <= 0.563 + 0.207: the two most likely stay
    assert torch.allclose(p[0], torch.cat([full[:2] / full[:2].sum(), torch.zeros(3)]))
    assert torch.equal(probs_of(logits, 1.0, top_p=0.5)[0], torch.tensor([1.0, 0, 0, 0, 0]))
    # top-p measures the mass after top-k: of the top 3 renormalised, 0.628 + 0.231 >= 0.85 already (of the
    # whole distribution, 0.770 < 0.85 would keep the third)
    p = probs_of(logits, 1.0, top_k=3, top_p=0.85)
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    # a tiny temperature is the argmax, not NaN
    assert torch.equal(probs_of(logits, 1e-30)[0], torch.tensor([1.0, 0, 0, 0, 0]))


def test_per_row_knobs_equal_each_row_alone():
    """A batch's knobs, one per row [T, 1]: each row gets bit for bit the probabilities of its own knobs alone, also a
    row that does not filter when another does (the batch then sorts every row)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    knobs = [(0.7, 50, 1.0), (1.3, 5, 1.0), (1.0, 50, 0.8)]  # (temperature, top_k, top_p)
    rows = target_probs(logits, *(torch.tensor([[kn[i]] for kn in knobs]) for i in range(3)), filtered=True)
    for i, (t, k, p) in enumerate(knobs):
        alone = probs_of(logits[i:i + 1], t, k if k < 50 else 0, p)
        assert torch.equal(rows[i:i + 1], alone)


@pytest.mark.parametrize("kw, words", [
    (dict(temperature=-0.1), "temperature must be"), (dict(temperature=float("nan")), "temperature must be"),
    (dict(temperature=1e300), "temperature must be at most 3.403e"),  # the sampler holds a float32
    (dict(top_p=0.0), "top_p must be in (0, 1]"), (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"), (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(seed=-1), "seed must be an integer"), (dict(seed=2 ** 64), "seed must be an integer"),
])
def test_bad_parameters(kw, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace("]", r"\]")) as e:
        SamplingParams(**kw)
    assert "\n" not in str(e.value)


# ---- exact losslessness of one round on a synthetic tree -------------------------------------------------------
# tokens 0..3; root -> children 0 and 1 (the draft's top 2); node 0 -> child 2; node 2 is a leaf at depth 2.
# The target's conditionals are multiples of 1/M, so a grid of M uniforms per level gives every draw its exact odds.
M = 10
P = {(): [0.4, 0.3, 0.2, 0.1], (0,): [0.1, 0.0, 0.6, 0.3], (1,): [0.5, 0.5, 0.0, 0.0], (0, 2): [0.2, 0.2, 0.3, 0.3]}
Q = {(): [0.5, 0.4, 0.05, 0.05], (0,): [0.1, 0.1, 0.7, 0.1]}  # the draft's distributions (top-k = the children)
NODES = [(), (0,), (1,), (0, 2)]  # tree order: the prefix each node stands for


def synthetic_tree() -> Tree:
    parent = torch.tensor([0, 0, 0, 1])
    depth = torch.tensor([len(s) for s in NODES])
    anc = torch.tensor([[len(b) <= len(a) and a[:len(b)] == b for b in NODES] for a in NODES])
    return Tree(tokens=torch.tensor([9, 0, 1, 2]), parent=parent, depth=depth, anc=anc)


def children(prefix):
    return [s[-1] for s in NODES if s[:-1] == prefix and s]


def ar_law(prefix=()) -> dict:
    """What AR sampling emits over the same positions: each token drawn from p, the round going on while the token
    is a child in the tree."""
    out = {}
    for y, py in enumerate(P[prefix]):
        if py == 0:
            continue
        if y in children(prefix):
            out |= {(y, *rest): py * pr for rest, pr in ar_law(prefix + (y,)).items()}
        else:
            out[(y,)] = py
    return out


def rejection_law(prefix=(), ratio=False) -> dict:
    """The recursive rejection rule, computed exactly: children tried in turn; accept x with min(1, p(x)/q(x)), on
    rejection p <- norm(max(0, p - q)); then the residual. q: a point mass on x (EAGLE-2's deterministic top-k), or,
    with ratio, the draft's softmax renormalised without the tried children (EAGLE-1 / SpecInfer's rule for
    children *sampled* from q)."""
    p, q = torch.tensor(P[prefix], dtype=torch.float64), torch.tensor(Q.get(prefix, [1.0] * 4), dtype=torch.float64)
    out, reach = Counter(), 1.0
    for x in children(prefix):
        prop = q / q.sum() if ratio else torch.eye(4, dtype=torch.float64)[x]
        a = min(1.0, float(p[x] / prop[x]))
        for rest, pr in rejection_law(prefix + (x,), ratio).items():
            out[(x, *rest)] += reach * a * pr
        reach *= 1 - a
        p = (p - prop).clamp(min=0)
        p /= p.sum()
        q[x] = 0
    for y in range(4):
        if reach * p[y] > 0:
            out[(y,)] += reach * float(p[y])
    return dict(out)


def grid_law(choose) -> dict:
    """The exact law of the emitted tokens of one round: `accept` with the choice of each node made by `choose`,
    over the whole grid of per-level uniforms."""
    tree = synthetic_tree()
    logits = torch.tensor([P[s] for s in NODES]).log()
    sampler = Sampler(lambda logits: logits.argmax(-1), torch.device("cpu"))
    sampler.start(0, SamplingParams(temperature=1.0, seed=0), 4)
    law = Counter()
    for u in itertools.product([(j + 0.5) / M for j in range(M)], repeat=3):
        sampler.uniform = lambda rows, pos, u=torch.tensor(u): u[pos]  # a node's position here: its tree level
        path, k, emitted = accept(one(tree), choose(sampler, logits, tree)[None], 3)  # a batch of one round
        law[tuple(emitted[0, : k[0] + 1].tolist())] += 1 / M ** 3
    return dict(law)


def tv(a: dict, b: dict) -> float:
    return sum(abs(a.get(s, 0) - b.get(s, 0)) for s in a.keys() | b.keys()) / 2


def one(tree: Tree) -> Tree:
    """A tree as a batch of one (speculative/batch_tree.py's layout)."""
    return Tree(tokens=tree.tokens[None], parent=tree.parent[None], depth=tree.depth[None], anc=tree.anc[None])


def first_child(tree: Tree, choice: torch.Tensor) -> torch.Tensor:
    """Broken rule: every node that has children accepts the first, whatever the target drew."""
    N = tree.tokens.numel()
    is_child = (tree.parent[None, :] == torch.arange(N)[:, None]) & (tree.depth[None, :] > 0)
    return torch.where(is_child.any(1), tree.tokens[is_child.float().argmax(1)], choice)


def test_tree_rejection_sampling_is_exactly_lossless():
    want = ar_law()
    assert sum(want.values()) == pytest.approx(1.0)
    # what the engine runs: one draw per node, walked like greedy
    assert tv(grid_law(lambda s, logits, t: s.choose(logits, 0, t.depth, "sample")), want) < 1e-6
    assert tv(rejection_law(), want) < 1e-9  # ... is EAGLE-2's recursive rejection with point-mass proposals
    # the check has teeth: a broken rule, and the ratio rule with q = the draft softmax on a top-k tree, both fail
    assert tv(grid_law(lambda s, logits, t: first_child(t, s.choose(logits, 0, t.depth, "sample"))), want) > 0.2
    assert tv(rejection_law(ratio=True), want) > 0.05


# ---- the real engine ---------------------------------------------------------------------------------------------
PROMPT, N_TOKENS = "The capital of France is", 3
KNOBS = dict(device="cpu", max_seq_len=64, depth=1, top_k=3, total_tokens=6)  # 3 levels: root, child, grandchild
SAMPLING = dict(temperature=2.0, top_k=2)  # a small support (8 sequences), spread out: enough with a few seeds
SEEDS = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Many tiny forwards: on 2 shared cores, a second OpenMP thread costs more than it gives."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ar(engine_dir):
    return LLM(engine_dir, "ar", **KNOBS)


@pytest.fixture(scope="module")
def spec(engine_dir):
    # fixed: every step a round (the checks below are about rounds; test_policy.py samples through every shape)
    return {m: LLM(engine_dir, m, spec_policy="fixed", **KNOBS) for m in ("eagle", "microspec")}


@pytest.fixture(scope="module")
def exact(ar) -> dict:
    """The AR law of the first N_TOKENS tokens, computed from the target's processed distributions."""
    def law(ids, left):
        pos = torch.arange(len(ids))
        h = ar.target(torch.tensor(ids), pos, pos, Span(torch.tensor(0), causal(len(ids), "cpu"), len(ids)))
        p = probs_of(ar.target.logits(h[-1:]), SAMPLING["temperature"], SAMPLING["top_k"])[0]
        out = {}
        for y in p.nonzero().flatten().tolist():
            rest = law(ids + [y], left - 1) if left > 1 else {(): 1.0}
            out |= {(y, *s): float(p[y]) * pr for s, pr in rest.items()}
        return out

    return law(ar.prompt_ids(PROMPT, False), N_TOKENS)


def fits(counts: Counter, law: dict) -> bool:
    """Whether the counts may come from the law: no sequence it never emits, and Pearson's chi-square (cells
    expecting fewer than 4 pooled) at a p-value above 1e-3."""
    n = sum(counts.values())
    if not set(counts) <= set(law):
        return False
    big = [s for s in law if law[s] * n >= 4]
    assert len(big) >= 2, "too few seeds for this law: the test would have no power"
    obs = [counts[s] for s in big] + [n - sum(counts[s] for s in big)]
    exp = [law[s] * n for s in big] + [n * (1 - sum(law[s] for s in big))]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), torch.tensor(stat / 2))) > 1e-3


def sample_counts(llm) -> tuple[Counter, float]:
    """The first tokens over SEEDS seeds, and the share of requests that accepted a drafted token."""
    counts, accepted = Counter(), 0
    for seed in range(SEEDS):
        r = llm.generate(PROMPT, N_TOKENS, seed=seed, **SAMPLING)
        counts[tuple(r.token_ids)] += 1
        accepted += r.stats["round_tokens"] > r.stats["rounds"]
    return counts, accepted / SEEDS


def test_ar_sampling_matches_the_target(ar, exact):
    counts, _ = sample_counts(ar)
    assert fits(counts, exact), counts


@pytest.mark.parametrize("method", ["eagle", "microspec"])
def test_speculative_sampling_matches_ar(method, spec, exact):
    llm = spec[method]  # with the trained head shipped with the engine
    counts, accepted = sample_counts(llm)
    assert accepted > 0.3  # drafted tokens really were accepted, not only the target's own draws emitted
    assert fits(counts, exact), counts


def test_same_seed_same_tokens_as_ar(ar, spec):
    """A token's uniform is a hash of the seed and its position (speculative/sampling.py): with one seed, speculative
    sampling emits AR's sampled tokens themselves, whatever the rounds accepted."""
    for seed in range(4):
        want = ar.generate(PROMPT, 8, seed=seed, **SAMPLING).token_ids
        for llm in spec.values():
            assert llm.generate(PROMPT, 8, seed=seed, **SAMPLING).token_ids == want, seed


def test_the_check_fails_a_broken_acceptance_rule(spec, exact, monkeypatch):
    """The test above, with every node accepting its first child whatever the target drew: it must fail."""
    def broken(tree, choice, P):  # first_child on each request's tree of the round
        rows = [first_child(Tree(tokens=tree.tokens[b], parent=tree.parent[b], depth=tree.depth[b],
                                 anc=tree.anc[b]), choice[b]) for b in range(choice.shape[0])]
        return accept(tree, torch.stack(rows), P)

    monkeypatch.setattr(spec_runner, "accept", broken)
    counts, _ = sample_counts(spec["microspec"])
    assert not fits(counts, exact), counts


def test_the_target_decides(ar, spec):
    """Greedy is untouched (temperature 0, whatever top_k / top_p say), and the filters act on the target: top_k=1
    or a tiny top_p at a high temperature leave only the target's argmax, whatever the draft proposes."""
    want = ar.generate(PROMPT, 6).token_ids
    for llm in (ar, spec["microspec"]):
        assert llm.generate(PROMPT, 6, temperature=0.0, top_k=5, top_p=0.5).token_ids == want
        assert llm.generate(PROMPT, 6, temperature=3.0, top_k=1, seed=1).token_ids == want
        assert llm.generate(PROMPT, 6, temperature=3.0, top_p=1e-6, seed=2).token_ids == want


def test_same_seed_same_output(spec):
    llm = spec["microspec"]
    runs = [llm.generate(PROMPT, 6, temperature=1.5, seed=s).token_ids for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


def cli(capsys, engine_dir, *extra):
    try:
        main(["generate", "--engine", str(engine_dir), "--device", "cpu", "--max-seq-len", "64",
              "--prompt", PROMPT, "--max-new-tokens", "6", "--json", *map(str, extra)])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, *capsys.readouterr()


@pytest.mark.parametrize("flag, value, words", [("--temperature", -1, "temperature must be"),
                                                ("--top-p", 0, "top_p must be in (0, 1]"),
                                                ("--top-k", -3, "top_k must be an integer >= 0")])
def test_cli_bad_values(capsys, engine_dir, flag, value, words):
    code, _, err = cli(capsys, engine_dir, flag, value)
    assert code == 2 and err.strip().count("\n") == 0 and err.startswith("microspec: error: ") and words in err, err
    with pytest.raises(SystemExit) as e:  # the gRPC client checks them before sending (no server here)
        main(["client", "--url", "127.0.0.1:1", "--prompt", "hi", flag, str(value)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().count("\n") == 0 and words in err, err


def test_cli_sampling(capsys, engine_dir, ar):
    code, out, err = cli(capsys, engine_dir, "--temperature", 1.5, "--top-k", 20, "--seed", 3)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == ar.generate(PROMPT, 6, temperature=1.5, top_k=20, seed=3).token_ids


def test_bench_sampled(capsys, engine_dir, tmp_path):
    args = ["bench", "--engine", str(engine_dir), "--device", "cpu", "--categories", "translation", "--limit", "1",
            "--max-new-tokens", "4", "--warmup", "0", "--temperature", "0.7", "--seed", "0", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main([*args, "--methods", "microspec,hf"])
    assert e.value.code == 2 and "run greedy only" in capsys.readouterr().err
    # the batched engine samples too; every step a round (its acceptance is read below; auto: the timing's pick)
    main([*args, "--methods", "microspec", "--concurrency", "1", "--spec-policy", "fixed"])
    res = json.loads((tmp_path / "results.json").read_text())
    run = res["runs"]["microspec"]
    assert run["lossless"] is None and run["summary"]["overall"]["acceptance_length"] >= 1
    assert run["batched"][0]["requests"] == 1 and run["batched"][0]["output_tokens_per_s"] > 0
    assert "sampled at temperature 0.7, top-p 1.0, top-k 0, seed 0" in (tmp_path / "results.md").read_text()
