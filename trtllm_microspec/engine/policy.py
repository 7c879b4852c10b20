"""The speculation policy of the batched engine: each step, how many tree tokens speculation gets.

A speculative round pays for its tree (the draft's depth + 1 head calls and total_tokens target rows per request)
and returns the tokens its requests accept; a plain step (shape 0: AR's step, one target row per request; the draft
catches up on the plain steps' rows at the request's next round, SpecRunner's lag buffer) returns one token per
request. Which pays depends on the step: on a GPU a 60-token tree at 1 request costs little more than a decode
step (the step is bound by reading the weights), at 64 requests it is compute-bound and costs many. So the policy
picks, every step, the shape among `shapes` that maximises the batch's expected tokens per second,

    goodput(s) = sum over the step's requests r of E_s(r)  /  cost(s, rows bucket),

with cost from `StepCosts` (seconds per step of each (shape, rows bucket), measured) and E_s(r) the request's
expected tokens per round under s. Plain decoding (E = 1) is always a candidate and wins ties, so speculation never
runs where it is expected to return less than it costs. The batch runs one shape per step (one pass, one graph per
shape bucket); each request's own acceptance weighs in through E_s(r).

Acceptance model: E_s(r) = 1 + rho_r (G_s - 1), where G_s is the shape's prior tokens per round (an EAGLE-2 tree
accepting a level with a chance that grows with the level's width: `prior_tokens`) and rho_r the request's running
ratio of what it accepted to that prior (an exponential average over its speculative rounds, starting from the
batch-wide one). The priors only rank the shapes against each other; rho carries what the head actually achieves
on the request's text. The policy never changes what is emitted: greedy stays AR's argmax and sampling AR's
distribution whatever it picks (the verification is lossless for any tree, the root-only one included).

`fixed` always runs the configured tree (the engine before this policy). Costs are calibrated per (shape, rows
bucket) on first need by timing a round of padding rows (SpecRunner.measure; at start-up on CUDA for every bucket,
capturing the graphs), then followed from the running engine: each step's measured time corrects that shape's
estimate at its bucket (`drift`), and only that shape's (a tree not yet run there follows the plain shape's until
its own steps come: StepCosts), because the calibration is not equally wrong for every shape (its padding rows read the shortest KV span and a round of them has no catch-up: on the H200 at one request
it priced a plain step at 1.56 ms that ran at 1.95, a 60-token round at 3.63 that ran at 3.85). A plain step that
overlaps the host's work (every decode-only one: Scheduler overlap) is timed when its tokens are read, one step
later: from the end of what the device ran before it, or from its launch where the device was idle. A shape's estimate
starts at its calibration, which reads low, so a shape that looks best is run and its real cost learnt; a step
that was its graph's first use (an eager run, then a capture) corrects nothing. A plain step moves every ratio a
little back toward the prior (PROBE), so speculation that stopped paying is tried again now and then: a request
whose text turns predictable, or a batch that shrinks, gets its trees back.
"""
from __future__ import annotations

from collections.abc import Callable

from ..speculative.tree import TreeConfig

POLICIES = ("auto", "fixed")
# why the policy ran a step plain, as the statistics report it (Stats.plain_reasons): the calibrated step costs alone
# (no tree pays even at the prior acceptance), or the acceptance the requests showed (a tree would pay at the prior)
PLAIN_REASONS = ("cost", "acceptance", "request")  # request: it asked not to speculate (SamplingParams.speculate)
# smaller trees the policy may pick below the configured one (each kept only if strictly smaller): the
# "16 tokens, depth 3, top-4" tree measured in issue 22, and a chain-like 4-token one for lightly loaded big batches
SMALLER_TREES = (TreeConfig(depth=3, top_k=4, total_tokens=16), TreeConfig(depth=1, top_k=2, total_tokens=4))
EMA = 0.2  # weight of a new observation in the running averages (acceptance ratio, cost drift)
# how far a plain step moves each acceptance ratio back toward the prior: a ratio is only observed on speculative
# rounds, so without it a request (and the batch) that once fell below the break-even would decode plainly for good,
# whatever its text or the load do later (on the H200 every Spec-Bench question ran plain after the warm-up). At
# 0.02, after a probe that returned nothing (EMA pulls the ratio down) ~11 plain steps pass before the next: where
# speculation never pays, about one step in twelve is a probe; near the break-even a probe costs next to nothing
PROBE = 0.02
# how much more than plain steps a tree must be expected to return for a joining request to speculate (`pays`). A
# step's choice is corrected by the next step's measured time; this one holds for the request's life (it decodes as
# AR's otherwise: SpecRunner.shares_prefix) and rests on calibrated costs that read low (their padding rows: see
# StepCosts) and on the prior acceptance: on one H100 at 64 requests a 4-token tree that the calibration put near the
# break-even ran 254 of 287 steps at 2x a plain step's time for 1.9 tokens (0.58x AR)
PAYS_MARGIN = 1.15


def tree_shapes(tree: TreeConfig, policy: str) -> list[TreeConfig | None]:
    """The shapes a step may run: None (plain decode rows) first, then trees from small to the configured one
    (fixed: that tree only, as shape 1)."""
    if policy == "fixed":
        return [None, tree]
    small = [t for t in SMALLER_TREES if t.total_tokens < tree.total_tokens and t.depth <= tree.depth]
    return [None, *sorted(small, key=lambda t: t.total_tokens), tree]


def prior_tokens(tree: TreeConfig | None, top1: float = 0.45, gamma: float = 0.3) -> float:
    """Tokens per round a tree is expected to give a typical head: each of its depth + 1 levels accepts with
    alpha = 1 - (1 - top1) w^-gamma, w the level's width (its tokens per level, at most top_k), after the previous
    level accepted; plus the bonus token."""
    if tree is None:
        return 1.0
    levels = tree.depth + 1
    w = min(tree.top_k, (tree.total_tokens - 1) / levels)
    alpha = 1 - (1 - top1) * w ** -gamma
    return 1 + sum(alpha ** i for i in range(1, levels + 1))


class StepCosts:
    """Seconds per step of each (shape index, rows bucket): measured once by `measure(shape, rows)` (on first
    need; a test passes its own), corrected by the steps of that shape and bucket the engine runs (`observe`). A
    tree with no steps of its own at a bucket yet is corrected as the plain shape is there: the calibration's
    padding rows read low for every shape, and plain steps (the most run) say by how much first; a tree's own steps
    then replace it. So a corrected plain cost is weighed against a tree's measured one, or against one corrected
    alike (as before any step: the calibrations' ratio), never against a bare calibration."""

    def __init__(self, measure: Callable[[int, int], float]):
        self.measure = measure
        self.base: dict[tuple[int, int], float] = {}
        self.drift: dict[tuple[int, int], float] = {}  # (shape, rows bucket) -> running ratio measured / calibrated

    def __call__(self, shape: int, rows: int) -> float:
        key = (shape, rows)
        if key not in self.base:
            self.base[key] = max(float(self.measure(shape, rows)), 1e-9)
        return self.base[key] * self.drift.get(key, self.drift.get((0, rows), 1.0))

    def known(self, shape: int, rows: int) -> float | None:
        """The estimate where one was made (calibrated, corrected by the steps run), else None: nothing measured
        on asking."""
        return self(shape, rows) if (shape, rows) in self.base else None

    def observe(self, shape: int, rows: int, seconds: float) -> None:
        key = (shape, rows)
        self(shape, rows)  # calibrated first
        ratio = seconds / self.base[key]
        d = self.drift.get(key)
        self.drift[key] = ratio if d is None else d + EMA * (ratio - d)


class SpecPolicy:
    def __init__(self, shapes: list[TreeConfig | None], policy: str, costs: StepCosts):
        if policy not in POLICIES:
            from ..models.registry import UserError
            raise UserError(f"unknown spec policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.shapes, self.policy, self.costs = shapes, policy, costs
        self.prior = [prior_tokens(t) for t in shapes]
        self.rho = 1.0  # the batch-wide acceptance ratio: where a new request starts
        self.why: str | None = None  # why the last choice was a plain step (PLAIN_REASONS), None: a tree

    def choose(self, reqs: list, rows: int, riders: int = 0) -> int:
        """The shape index of this step for the speculating `reqs` and `riders` requests that decode as AR's (one
        token each, whatever the shape), their rows bucket `rows`."""
        if self.policy == "fixed":
            return len(self.shapes) - 1
        n = len(reqs) + riders
        best = self.best(sum(self.ratio(r) for r in reqs), n, rows)
        # why a step runs plain, for the requests' statistics: at the prior acceptance (every ratio 1) no tree
        # returns more tokens per second than a plain step (the measured costs alone decide), or one would, and
        # the acceptance the requests showed is what keeps it plain
        self.why = None if best else ("acceptance" if self.best(len(reqs), n, rows) else "cost")
        return best

    def pays(self, n: int, rows: int) -> bool:
        """Whether some tree returns PAYS_MARGIN times the tokens per second of plain rows for n requests (rows
        bucket `rows`) at the prior acceptance: where none does, the batch is too big for speculation to pay
        whatever its text (`fixed`: always)."""
        return self.policy == "fixed" or self.best(n, n, rows, PAYS_MARGIN) > 0

    def best(self, rho: float, n: int, rows: int, margin: float = 1.0) -> int:
        """The shape of the most expected tokens per second for n requests whose acceptance ratios sum to rho:
        sum of E_s(r) = n + rho (G_s - 1); a tree only where it beats plain rows `margin` times."""
        best, best_rate = 0, margin * n / self.costs(0, rows)
        for s in range(1, len(self.shapes)):
            rate = (n + rho * (self.prior[s] - 1)) / self.costs(s, rows)
            if rate > best_rate:
                best, best_rate = s, rate
        return best

    def table(self, rows: int) -> list[dict]:
        """What the policy weighs at a rows bucket, per shape: its tokens (plain: 1), its prior tokens a round and
        its estimated step seconds (None: not measured there) -- why a batch of that size speculates or not."""
        return [{"tokens": 1 if t is None else t.total_tokens, "prior": g, "seconds": self.costs.known(s, rows)}
                for s, (t, g) in enumerate(zip(self.shapes, self.prior))]

    def ratio(self, req) -> float:
        return self.rho if req.accept_ratio is None else req.accept_ratio

    def timed(self, shape: int, rows: int, seconds: float) -> None:
        """A step's time that comes after its `observe` (an overlapped plain step's, read one step later)."""
        if self.policy != "fixed":
            self.costs.observe(shape, rows, seconds)

    def observe(self, reqs: list, shape: int, rows: int, tokens: list[int], seconds: float | None) -> None:
        """A step ran: its time corrects the cost model (None: not a step's own time, a graph's first use), a
        speculative round's tokens per request each request's acceptance ratio (and the batch's)."""
        if self.policy == "fixed":  # nothing to decide: no cost to measure
            return
        if seconds is not None:
            self.timed(shape, rows, seconds)
        if self.shapes[shape] is None:  # nothing observed: the ratios drift back toward the prior (PROBE)
            for r in reqs:
                now = self.ratio(r)
                r.accept_ratio = now + PROBE * (1.0 - now)
            self.rho += PROBE * (1.0 - self.rho)
            return
        g = self.prior[shape] - 1
        for r, t in zip(reqs, tokens):
            seen, now = (t - 1) / g, self.ratio(r)
            r.accept_ratio = now + EMA * (seen - now)
            self.rho += EMA / len(reqs) * (seen - self.rho)
