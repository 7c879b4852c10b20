"""Sampling (temperature, top-k, top-p, seed) and lossless speculative sampling over the EAGLE-2 tree.

All device tensor ops with static shapes: no host sync, capturable in a CUDA graph. Temperature, top-k and top-p
shape the TARGET's distribution p, the one that decides every emitted token (HF / TensorRT-LLM order: temperature,
then top-k, then top-p over what top-k kept).

Verification. EAGLE-2's tree is not sampled: its nodes are the draft's top-k, a deterministic function of the
committed text, so the proposal at a child c is a point mass, q = delta(c). EAGLE's recursive rejection with such
proposals (SafeAILab/EAGLE, EAGLE-2 `evaluate_posterior`: `qx = 1.0`) tries the children c_1..c_m of the current
node in turn: accept c_i with probability min(1, p(c_i) / 1) under the current p; on rejection
p <- norm(max(0, p - delta(c_i))), i.e. p with c_i zeroed; if every child is rejected, draw from that residual. Child
c_i is then emitted with probability (1 - p_1 - .. - p_{i-1}) * p_i / (1 - p_1 - .. - p_{i-1}) = p_i, and a token y
that is no child with probability (1 - sum_c p_c) * p(y) / (1 - sum_c p_c) = p(y): the node emits exactly one draw
from p, whatever the tree holds. So each node draws y ~ p (inverse CDF, one uniform) and the walk continues into the
child whose token is y: the greedy `accept` with the argmax replaced by that draw. The emitted text is therefore
distributed as the target's own sampling, for any draft and any draft vocabulary (MicroSpec's window only changes
which children exist). The ratio rule min(1, p(x) / q(x)) with q = the draft's softmax is lossless only for children
*sampled* from q (EAGLE-1's sampled tree); on EAGLE-2's top-k tree it is not (a child with q = 0.5 and p = 0.3 would
be emitted with probability 0.6) -- tests/test_sampling.py shows it failing.

Randomness: the uniform of a token is a hash of the request's seed and the token's position in the sequence
(`uniforms`), shared by the nodes of a tree level (they all stand for the same position). Only one node per level is
on the walked path and which one depends on the levels above only, so every step of the walk uses a fresh uniform;
siblings with equal tokens (padding slots of a small window) draw the same y, so which of them the walk enters does
not matter. A draw that the walk leaves (a node off the path) decides nothing, so its position's uniform is still
fresh when a later step draws there. Each emitted token is therefore the inverse-CDF draw of its position's uniform
from the target's distribution given the text before it -- what AR sampling emits with the same seed: with one seed,
every method, tree size and batch gives the same tokens, and no uniform is drawn on the host (no launch per
request per step).
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace

import torch

from .. import parallel
from ..models.registry import UserError

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy, token for token the AR output
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose mass reaches top_p
    top_k: int = 0  # keep the top_k most likely tokens; 0: no limit
    seed: int | None = None  # None: a fresh random seed per request
    # False: under a speculative method this request decodes as AR's (no draft tree of its own: it rides its batch's
    # rounds for one token a step); its tokens are the same either way (vLLM's and SGLang's users ask for it: a
    # request the head cannot help, or traffic the operator knows speculation does not pay for)
    speculate: bool = True

    def __post_init__(self):
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if not isinstance(self.speculate, bool):
            raise UserError(f"speculate must be true or false, got {self.speculate!r}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if t > FLOAT32_MAX:  # the sampler holds it as a float32
            raise UserError(f"temperature must be at most {FLOAT32_MAX:.4g}, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise UserError(f"top_k must be an integer >= 0 (0 = no limit), got {k!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2 ** 64):
            raise UserError(f"seed must be an integer in [0, 2^64), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:  # top-k / top-p need a sort over the vocabulary; plain temperature does not
        return self.top_k > 0 or self.top_p < 1

    def seeded(self) -> SamplingParams:
        """These params with a seed: seed None draws a fresh one here, once per request, so that a request preempted
        and recomputed goes on with the same random stream."""
        return replace(self, seed=secrets.randbits(64)) if self.seed is None and not self.greedy else self


GREEDY = SamplingParams()


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 filtered: bool) -> torch.Tensor:
    """[T, V] logits -> [T, V] fp32 probabilities after temperature, top-k (k >= 1) and top-p: device scalars, or
    [T, 1] with one value per row (a batch of requests)."""
    x = logits.float()
    x = (x - x.amax(-1, keepdim=True)) / temperature  # shift first: a tiny temperature gives -inf, never inf - inf
    if filtered:
        s, order = x.sort(-1, descending=True)
        s = s.masked_fill(torch.arange(x.shape[-1], device=x.device) >= top_k, float("-inf"))
        p = s.softmax(-1)
        # a token stays while the mass before it is below top_p (the most likely one always stays); top_p = 1
        # keeps all, even where the float cumsum reaches 1 early
        keep = (p.cumsum(-1) - p < top_p) | (top_p >= 1)
        x = torch.full_like(x, float("-inf")).scatter(-1, order, s.masked_fill(~keep, float("-inf")))
    return x.softmax(-1)


def tempered(hidden: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """A sampling draft's hidden divided by the temperature (so are its logits, the head being linear), back in the
    hidden's dtype (the knobs are fp32, the head rows bf16); None (greedy): unchanged."""
    return hidden if temperature is None else (hidden / temperature).to(hidden.dtype)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [T, V] by inverse CDF, with u [T] (or a scalar) uniform in [0, 1).
    With 1 - u in (0, 1], the first index whose cumulative mass reaches (1 - u) * total always has probability > 0."""
    c = probs.cumsum(-1)
    return (c < (1 - u)[..., None] * c[..., -1:]).sum(-1)


M32 = 0xFFFFFFFF


def _mul32(h, c: int):
    """(h * c) mod 2^32 for h in [0, 2^32) (an int64 tensor or an int), without an int64 overflow."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & M32


def fmix32(h):
    """MurmurHash3's finaliser: a bijection of [0, 2^32) whose every output bit depends on every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms(key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The uniform in [0, 1) of each token position pos [T] (int64) of the requests whose keys are key [T, 2]: a
    counter-based stream (a hash of key and position, 24 bits as torch.rand's float32), capturable in a graph."""
    h = fmix32((pos & M32) ^ key[..., 0])
    h = fmix32(h ^ key[..., 1])
    return (h >> 8).float() * 2.0 ** -24


class Sampler:
    """The sampling state of `rows` requests (the batch slots of the batched engine), in persistent device tensors that captured CUDA graphs read: each row's knobs, whether it samples,
    and its key, from its seed: the uniform of a token is `uniforms(key, position)`, computed inside the step. Greedy
    rows draw nothing and take the target's argmax, as before, also beside sampling rows in one batch."""

    def __init__(self, argmax, device: torch.device, rows: int = 1):
        self.argmax = argmax  # the target's (vocabulary-split under tensor parallelism)
        # [rows, 1]: a row's knobs broadcast over its logits' vocabulary dimension
        self.sampled = torch.zeros(rows, 1, dtype=torch.bool, device=device)
        self.temperature = torch.ones(rows, 1, device=device)
        self.top_k = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.top_p = torch.ones(rows, 1, device=device)
        self.key = torch.zeros(rows, 2, dtype=torch.long, device=device)
        self.params = [GREEDY] * rows
        self.nongreedy: set[int] = set()  # the rows whose params sample (mode's all-greedy case without a scan)
        self.knobs: list[tuple | None] = [None] * rows  # what start last wrote into each row's knob tensors

    def start(self, row: int, params: SamplingParams, vocab_size: int) -> None:
        if not params.greedy and parallel.world() > 1:
            raise UserError("sampling with tensor parallelism (--tp > 1) is not supported yet: use temperature 0")
        self.params[row] = params
        if params.greedy:
            self.nongreedy.discard(row)
        else:
            self.nongreedy.add(row)
        knobs = (params.temperature, params.top_k, params.top_p, vocab_size)
        if self.knobs[row] != knobs:  # else the row holds them already: e.g. a greedy join after a greedy one
            self.knobs[row] = knobs
            self.sampled[row] = not params.greedy
            # a greedy row of a mixed batch runs the sampling math too (its draw is dropped): keep it finite
            self.temperature[row] = params.temperature or 1.0
            self.top_k[row] = params.top_k or vocab_size
            self.top_p[row] = params.top_p
        if params.greedy:
            return
        seed = params.seed  # set when the request was added (SamplingParams.seeded)
        # both halves of the 64-bit seed in each word of the key: seeds differing anywhere give other streams
        # (two scalar writes, not a host tensor's copy: that would wait for the GPU's step in flight)
        self.key[row, 0] = fmix32((seed & M32) ^ fmix32(seed >> 32))
        self.key[row, 1] = fmix32(((seed >> 32) ^ 0x9E3779B9) ^ fmix32(seed & M32))

    def mode(self, rows: list[int]) -> str:
        """Which code a step of these rows runs, so each gets its own CUDA graphs: the argmax only (all greedy), or
        the sampling math too, with the top-k / top-p sort when any row filters (the rows that do not come through
        it unchanged)."""
        if not self.nongreedy:
            return "greedy"
        params = [self.params[r] for r in rows]
        return ("greedy" if all(p.greedy for p in params) else "top-k/p" if any(p.filtered for p in params)
                else "sample")

    def draft_temperature(self, rows, mode: str) -> torch.Tensor | None:
        """The temperature each row's draft scores its tree with (batch_tree.draft_trees; greedy rows: 1)."""
        return None if mode == "greedy" else self.temperature[rows]

    def uniform(self, rows, pos: torch.Tensor) -> torch.Tensor:
        return uniforms(self.key[rows], pos)

    def choose(self, logits: torch.Tensor, rows, pos: torch.Tensor, mode: str) -> torch.Tensor:
        """The target's token for each row of logits [T, V]: its argmax (greedy rows), or a draw from its processed
        distribution with the uniform of the row's request and the position of the token it chooses. rows: the
        sampler row of each logits row [T], or one int for all; pos: [T] (int64, on the logits' device)."""
        argmax = self.argmax(logits)
        if mode == "greedy":
            return argmax
        p = target_probs(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows], mode == "top-k/p")
        return torch.where(self.sampled[rows, 0], draw(p, self.uniform(rows, pos)), argmax)
