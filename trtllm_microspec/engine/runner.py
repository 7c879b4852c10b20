"""The model runner of the batched engine: a paged KV pool, per-request device state in batch slots, and one
target pass per step for the whole batch: the prompt chunks of the requests being prefilled and one decode row per
running request together (`step`), under the scheduler's token budget.

Each running request holds a batch slot: its row of the block table lives on the device from join to leave (the
blocks of an AR request are appended as it grows). A decode-only step's inputs (last token, committed length, slot
of each row) are copied from the host into one persistent buffer, so the step itself has no host reads; on CUDA it
is captured in a graph per (batch-size bucket, span bucket, sampling mode) and replayed. Rows past the real batch
(up to the batch-size bucket, on every device, so the CPU tests run what the graphs capture) are padding: a greedy
request of length 0 in the padding slot, whose table points at the pool's block 0 (never handed out). A step with
prompt chunks runs eagerly: its rows are packed (no padding), each chunk attends as its own Span, the decode rows as
one (plugins/layers.py Spans).

Sampling: each batch slot is a row of one Sampler (spec/sampling.py), set when a request joins, with the key of its
seed; the uniform of a token is a hash of that key and the token's position, computed inside the step, so a
request's tokens are those it gets alone with the same SamplingParams and seed, whatever the batch, the step's tree
or a preemption (recomputed, its tokens keep their positions).
"""
from __future__ import annotations

import heapq
import time

import torch

from plugins.layers import KV_BLOCK

from .. import parallel
from ..models.model import KVCache, Span, Spans, Transformer
from ..models.registry import UserError
from ..spec.batch_tree import accept, causal_mask, draft_trees, physical, verify
from ..spec.sampling import Sampler, tempered
from ..spec.tree import Tree, TreeConfig, causal
from ..vocab.batched import batch_vocab
from .block_manager import BlockManager, pool_blocks
from .graphs import GraphRunner, bucket_for
from .policy import SpecPolicy, StepCosts, tree_shapes

DEFAULT_KV_MEMORY = {"cuda": 0.5, "cpu": 0.5}  # fraction of free GPU memory / GiB on the CPU
# tokens of target work per step (prompt chunks + decode rows): a GPU step at 8k rows is GEMM-bound (vLLM chunks at
# 8k-16k); on the CPU a smaller pass keeps the running requests' inter-token latency bounded
DEFAULT_MAX_NUM_TOKENS = {"cuda": 8192, "cpu": 1024}
PREFILL_CHUNK = 512  # prompt rows per LM-head call when collecting top-K_pre (never [L x V] at once)


def round_reserve(tree: TreeConfig | None) -> int:
    """Cache slots a step may write past the committed length: a speculative round's tree, compacted path and
    draft expansions; an AR step its one token (tree None)."""
    return max(tree.total_tokens, tree.max_path + tree.draft_slots) if tree else 1


def check_request(prompt_ids: list[int], max_new_tokens: int, max_seq_len: int, vocab_size: int,
                  reserve: int) -> None:
    """The one rule for a request, on every path (generate, a batch, serving): a prompt leaves room for one step
    (`reserve` slots) and its first token within max_seq_len."""
    if not prompt_ids:
        raise UserError("the prompt is empty")
    if max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be positive, got {max_new_tokens}")
    limit = max_seq_len - reserve - 1
    if len(prompt_ids) > limit:
        room = "one speculative round (its draft tree) and" if reserve > 1 else "one decode step and"
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; this engine accepts at most {limit}: max_seq_len "
                        f"{max_seq_len} less {reserve + 1} cache slots of room for {room} the next token")
    if max(prompt_ids) >= vocab_size or min(prompt_ids) < 0:
        raise UserError("the prompt has token ids outside the vocabulary")


def batch_bucket(B: int, max_batch: int) -> int:
    b = 1
    while b < B:
        b *= 2
    return min(b, max_batch)


class BatchRunner:
    grows = True  # blocks are appended as a request grows (and it may be preempted, then recomputed)
    prefill_cap: int | None = None  # prompt tokens a step may take besides the budget (None: the budget alone)

    def __init__(self, target: Transformer, max_batch: int, kv_memory: float | None = None,
                 cuda_graphs: bool = False, extra_layers: int = 0, reserve: int = 1,
                 max_num_tokens: int | None = None, decode_rows: int = 1):
        c, dev, dtype = target.cfg, target.cache.k.device, target.cache.k.dtype
        self.target, self.max_batch, self.device = target, max_batch, dev
        self.stop_ids = list(c.eos_ids)
        self.reserve = reserve  # slots a step writes past the committed length
        self.decode_rows = decode_rows  # target rows a running request adds to a step (AR 1, a tree its tokens)
        self.max_num_tokens = max_num_tokens or max(DEFAULT_MAX_NUM_TOKENS[dev.type], max_batch * decode_rows)
        if self.max_num_tokens < max_batch * decode_rows:
            raise UserError(f"max_num_tokens {self.max_num_tokens} is below max_batch {max_batch} x {decode_rows} "
                            f"(the rows every running request decodes in a step): raise it or lower max_batch")
        kv_memory = kv_memory or DEFAULT_KV_MEMORY[dev.type]
        layers = c.num_layers + extra_layers  # the draft's pool shares the block ids (one table for both)
        # k and v of every layer, plus the slot positions (int64) of up to two pools
        per_block = 2 * layers * c.num_kv_heads * KV_BLOCK * c.head_dim * dtype.itemsize + 16 * KV_BLOCK
        # table columns: S buckets reach up to max_seq_len, a padded prefill chunk (SpecRunner) up to a budget past it
        width = -(-(c.max_seq_len + self.max_num_tokens) // KV_BLOCK)
        # under --tp every rank schedules alike: the same pool on each (the smallest of their free memories)
        self.blocks = BlockManager(parallel.agree(pool_blocks(kv_memory, per_block, dev), dev, "min"),
                                   -(-c.max_seq_len // KV_BLOCK))
        self.cache = KVCache(c, c.num_layers, dtype, dev, slots=self.blocks.num_blocks * KV_BLOCK)
        # one table row per batch slot, plus the padding slot (all block 0)
        self.table = torch.zeros(max_batch + 1, width, dtype=torch.long, device=dev)
        self.pad = max_batch
        # a heap: a request takes the lowest free slot, so the running ones stay packed at the front (the
        # batched MicroSpec draft head runs over slots 0 .. the highest one in use)
        self.free_slots = list(range(max_batch))
        self.inp = torch.zeros(3, max_batch, dtype=torch.long, device=dev)  # rows: last token, n, batch slot
        self.next = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.one = causal(1, dev)[None]
        self.sampler = Sampler(target.argmax, dev, max_batch + 1)  # a row per batch slot and the padding slot (greedy)
        self.graphs = GraphRunner() if cuda_graphs else None
        self.tri = causal(1, dev)  # the causal mask of the longest chunk so far: a chunk's mask is a view of it

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        check_request(prompt, max_new_tokens, self.target.cfg.max_seq_len, self.target.cfg.vocab_size, self.reserve)

    def slots_for(self, prompt: list[int], max_new_tokens: int) -> int:
        """A request stops at max_seq_len whatever its budget (Scheduler: "length"), as on the single path."""
        return min(len(prompt) + max_new_tokens + self.reserve, self.target.cfg.max_seq_len)

    def join(self, req, blocks: list[int]) -> None:
        req.slot = heapq.heappop(self.free_slots)
        row = torch.zeros(self.table.shape[1], dtype=torch.long)
        row[:len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self.table[req.slot].copy_(row)
        self.sampler.start(req.slot, req.params, self.target.cfg.vocab_size)

    def map_blocks(self, updates: list[tuple[int, int, int]]) -> None:
        """(batch slot, table column, block) of every block handed out this step, into the table in one write."""
        if updates:
            slot, col, block = torch.tensor(updates, dtype=torch.long).to(self.device).T
            self.table.index_put_((slot, col), block)

    def leave(self, req) -> None:
        if req.slot >= 0:
            heapq.heappush(self.free_slots, req.slot)
            req.slot = -1

    def preempt(self, req) -> None:
        """The request leaves to be recomputed later (its uniforms are those of its tokens' positions: the same
        then)."""
        self.leave(req)

    def plan(self, reqs: list) -> int:
        """Target rows each decoding request adds to this step (AR: one)."""
        return 1

    def step(self, chunks: list[tuple], decodes: list) -> tuple[list[list[int] | None], list[list[int]]]:
        """One target pass: the next chunk of each (request, chunk length) being prefilled and one decode row per
        request of `decodes`. Returns each chunk's first token once its request's prompt is in (else None) and each
        decode's token. Without chunks, the (graph-captured) decode step."""
        if not chunks:
            return [], self.decode(decodes) if decodes else []
        t, dev = self.target, self.device
        lens = [c for _, c in chunks]
        starts = [req.prefilled for req, _ in chunks]
        ids = [tok for req, c in chunks for tok in req.chunk(c)] + [r.last for r in decodes]
        P = len(ids) - len(decodes)  # prompt rows
        lens_t = torch.tensor(lens)
        offsets = lens_t.cumsum(0) - lens_t  # each chunk's first row
        slots = torch.arange(P) + (torch.tensor(starts) - offsets).repeat_interleave(lens_t)  # each row's logical slot
        ends = [b for b, (req, c) in enumerate(chunks) if req.prefilled + c == req.seq_len]  # prompt done: a token
        rows = [int(offsets[b]) + lens[b] - 1 for b in ends] + list(range(P, P + len(decodes)))
        sample = [chunks[b][0].slot for b in ends] + [r.slot for r in decodes]
        # the position of each sampled token: after its prompt, or after its request's last token
        at = [starts[b] + lens[b] for b in ends] + [r.n + 1 for r in decodes]
        # every index of the pass in one host -> device copy
        host = torch.cat([torch.tensor(ids), slots, torch.tensor([r.n for r in decodes], dtype=torch.long),
                          torch.tensor(starts), torch.tensor(rows, dtype=torch.long),
                          torch.tensor(sample + [r.slot for r in decodes], dtype=torch.long),
                          torch.tensor(at, dtype=torch.long)])
        dv = host.to(dev).split([len(ids), P, len(decodes), len(chunks), len(rows), len(sample) + len(decodes),
                                 len(at)])
        tokens, n_dec, n_chunk, rows_d, slot_d, at_d = dv[0], dv[2], dv[3], dv[4], dv[5], dv[6]
        slots_d = torch.cat([dv[1], n_dec])
        if max(lens) > self.tri.shape[0]:
            self.tri = causal(1 << (max(lens) - 1).bit_length(), dev)
        parts = [Span(n_chunk[b:b + 1], self.tri[None, :c, :c], starts[b] + c, self.table[req.slot:req.slot + 1])
                 for b, (req, c) in enumerate(chunks)]
        if decodes:
            dec_slots = slot_d[len(sample):]
            parts.append(Span(n_dec, self.one.expand(len(decodes), 1, 1), max(r.n for r in decodes) + 1,
                              self.table.index_select(0, dec_slots)))
        h = t(tokens, self.positions(slots_d), slots_d, Spans(parts), cache=self.cache)
        toks = []
        if sample:
            toks = self.sampler.choose(t.logits(h[rows_d]), slot_d[:len(sample)], at_d, self.sampler.mode(sample))
            toks = toks.tolist()  # the one host read of the step
        out: list[list[int] | None] = []
        done = iter(toks)
        for req, c in chunks:
            req.prefilled = req.n = req.prefilled + c
            if req.prefilling:
                out.append(None)
            else:
                req.last = next(done)
                out.append([req.last])
        decoded = []
        for r in decodes:
            r.n += 1
            r.last = next(done)
            decoded.append([r.last])
        return out, decoded

    def prefill(self, chunks: list[tuple]) -> list[list[int] | None]:
        """The next prompt chunk of each (request, chunk length), in one target pass. Returns each request's first
        token once its whole prompt is in, else None."""
        _, h, _, _ = self.target_prefill(chunks)
        return self.first_tokens(chunks, h)

    def first_tokens(self, chunks: list[tuple], h: torch.Tensor) -> list[list[int] | None]:
        """Each request past its chunk; the first token of each whose prompt is now in (from its chunk's last row
        of h [B, T, d]), else None."""
        out = []
        for b, (req, c) in enumerate(chunks):
            req.prefilled = req.n = req.prefilled + c
            if not req.prefilling:
                req.last = int(self.first_token(req, self.target.logits(h[b, c - 1:c])))
            out.append(None if req.prefilling else [req.last])
        return out

    def target_prefill(self, chunks: list[tuple]):
        """One target pass of B requests x T rows (T the longest chunk) instead of one pass per request, whose
        launches dominate an eager prefill. A shorter chunk is padded with rows after its own; they write the
        request's next slots (written again before anything reads them) or, past its blocks, the pool's block 0,
        and their outputs are dropped. Returns ids [B, T], hidden [B, T, d], the rows' logical slots [B, T] and
        their Span (the draft's prefill reuses them)."""
        t, dev, B = self.target, self.device, len(chunks)
        T = max(c for _, c in chunks)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, (req, c) in enumerate(chunks):
            ids[b, :c] = torch.tensor(req.chunk(c))
        start = torch.tensor([req.prefilled for req, _ in chunks])
        slots = (start[:, None] + torch.arange(T)).to(dev)
        table = self.table.index_select(0, torch.tensor([req.slot for req, _ in chunks], device=dev))
        span = Span(start.to(dev), causal(T, dev).expand(B, T, T), int(start.max()) + T, table)
        ids = ids.to(dev)
        h = t(ids.flatten(), self.positions(slots), slots.flatten(), span, cache=self.cache)
        return ids, h.view(B, T, -1), slots, span

    def positions(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.flatten().clamp(max=self.target.cfg.max_seq_len - 1)  # a padding row may pass the rotary table

    def first_token(self, req, logits: torch.Tensor) -> torch.Tensor:
        """The token after the prompt [1] (at position req.n, the prompt's length)."""
        pos = torch.full((1,), req.n, dtype=torch.long, device=self.device)
        return self.sampler.choose(logits, req.slot, pos, self.sampler.mode([req.slot]))

    def prepare(self, reqs: list, rows: int) -> tuple[int, str]:
        """The host side of a step: each request's (last token, committed length, batch slot) into the persistent
        input buffer, `rows` - len(reqs) padding rows after them. Returns the KV span S (a bucket under CUDA
        graphs) and the sampling mode: with the row count, what a step's graph is keyed by."""
        pad = [(0, 0, self.pad)] * (rows - len(reqs))
        self.inp[:, :rows].copy_(torch.tensor([(r.last, r.n, r.slot) for r in reqs] + pad).T)
        S = max(r.n for r in reqs) + self.reserve
        if self.graphs:
            S = bucket_for(S, self.target.cfg.max_seq_len)
        return S, self.sampler.mode([r.slot for r in reqs])

    def launch(self, key: tuple, fn) -> None:
        """Run a step: eagerly, or through the CUDA graph of its key (greedy and sampling steps differ)."""
        if self.graphs:
            self.graphs.begin_round(key)
            self.graphs("step", key, fn)
        else:
            fn()

    def decode(self, reqs: list) -> list[list[int]]:
        """One AR step for the batch: one target pass over one row per request."""
        B = len(reqs)
        Bb = batch_bucket(B, self.max_batch)
        S, mode = self.prepare(reqs, Bb)
        self.launch((Bb, S, mode), lambda: self._decode(Bb, S, mode))
        out = self.next[:B].tolist()  # the one host read per step
        for r, tok in zip(reqs, out):
            r.n += 1
            r.last = tok
        return [[tok] for tok in out]

    def _decode(self, Bb: int, S: int, mode: str) -> None:
        tok, n, slot = self.inp[0, :Bb], self.inp[1, :Bb], self.inp[2, :Bb]
        span = Span(n, self.one.expand(Bb, 1, 1), S, self.table.index_select(0, slot))
        h = self.target(tok, n, n, span, cache=self.cache)
        self.next[:Bb].copy_(self.sampler.choose(self.target.logits(h), slot, n + 1, mode))


class SpecRunner(BatchRunner):
    """Batched EAGLE-2 rounds (every speculative method: eagle, frspec, the MicroSpec windows and their
    ablations) with an EAGLE-1/2 or EAGLE-3 head: every request drafts its own tree through its own draft
    vocabulary, one target pass verifies all trees, acceptance and KV compaction per request. make_vocab's
    vocabulary becomes the batch's (vocab/batched.py): shared full/static rows, or a MicroSpec window (ring, counts,
    active ids, packed head rows) per batch slot, reset when a request joins. Each step runs the shape the
    speculation policy picks (engine/policy.py): a tree, or plain rows (the root alone, the window and the draft
    carried on). A step is one device step with no host read but the one of its results, captured in a CUDA graph
    per (shape, rows bucket, head slots bucket, span bucket, sampling mode); padding rows leave every window as it
    is. The draft is called through `draft.cfg` (the shapes of the KV pool allocated for it),
    `draft.hidden(tokens, features, positions, slots, span, cache=)`, `draft.features(h)` (its input feature from
    the target's pass that gave h: the hidden itself, EAGLE-3 its three tapped layers) and `draft.head_in(h)` (the
    vocabulary head's input) only. Prompts are
    prefilled in chunks, the draft beside the target, in their own pass before the round (padded to the longest
    chunk; one pass for both is the next step). A request's blocks are all taken when it joins: its window and draft
    state could not be recomputed token for token after a preemption, so none is preempted."""

    grows = False
    # its prefill pass pads every chunk to the longest (B x T rows): the prompt tokens of a step stay few, as before
    prefill_cap = 512

    def __init__(self, target: Transformer, draft, vocab, tree: TreeConfig, k_pre: int, k_ver: int,
                 max_batch: int, kv_memory: float | None = None, cuda_graphs: bool = False,
                 max_num_tokens: int | None = None, spec_policy: str = "auto", costs: StepCosts | None = None):
        """spec_policy: auto (engine/policy.py: each step's tree from the step's cost and the requests' acceptance)
        or fixed (always `tree`); costs: the policy's cost model (None: measured by timing padding rounds)."""
        shapes = tree_shapes(tree, spec_policy)
        super().__init__(target, max_batch, kv_memory, cuda_graphs, extra_layers=1,
                         reserve=max(round_reserve(t) for t in shapes if t),
                         max_num_tokens=max_num_tokens, decode_rows=tree.total_tokens)
        self.draft, self.tree, self.k_pre, self.k_ver = draft, tree, k_pre, k_ver
        self.shapes = shapes
        self.policy = SpecPolicy(shapes, spec_policy, costs or StepCosts(self.measure))
        self.planned: int | None = None  # the shape the scheduler planned this step's budget with
        dev = self.device
        # the draft's own KV pool, with the target's block ids (draft.cfg: its layers and KV shapes)
        self.dcache = KVCache(draft.cfg, draft.cfg.num_layers, self.cache.k.dtype, dev, slots=self.cache.pos.numel())
        self.vocab = batch_vocab(vocab, max_batch + 1)  # the padding slot too: padding rows read it
        if hasattr(self.vocab, "reset"):  # every slot a valid (pinned ids) window: a padding row may read a free one
            for s in range(max_batch + 1):
                self.vocab.reset(s)
        self.h_last = torch.zeros(max_batch + 1, draft.cfg.hidden_size, dtype=self.cache.k.dtype, device=dev)
        self.steps = torch.arange(tree.max_path, device=dev)
        self.topk_pre: dict[int, list[torch.Tensor]] = {}  # batch slot -> its prompt chunks' top-K_pre so far
        # what the host reads after a round, per row: accepted k, vocabulary size, covered, emitted tokens
        self.out = torch.zeros(max_batch, 3 + tree.max_path, dtype=torch.long, device=dev)

    def prefill(self, chunks: list[tuple]) -> list[list[int] | None]:
        """The next prompt chunk of each request in one target pass and one draft pass: the draft at position i
        reads the target's hidden there and token i + 1 (the prompt's; the first token at its end), so a chunk
        needs nothing from the next one. A request's window starts once its whole prompt is in, from its prompt and
        its top-K_pre, as alone. Returns each request's first token once its prompt is in, else None."""
        t = self.target
        ids, h, slots, span = self.target_prefill(chunks)
        nxt = torch.zeros_like(ids)
        for b, (req, c) in enumerate(chunks):
            a = req.prefilled
            if a == 0:
                self.topk_pre[req.slot] = []
            self.topk_pre[req.slot].append(torch.cat([t.topk(t.logits(h[b, i:min(i + PREFILL_CHUNK, c)]), self.k_pre)
                                                      .flatten() for i in range(0, c, PREFILL_CHUNK)]))
            after = req.prompt[a + 1:a + c + 1]  # one short at the prompt's end: the first token goes there
            nxt[b, :len(after)] = torch.tensor(after, dtype=torch.long)
        out = self.first_tokens(chunks, h)
        ends = [(b, c - 1, req) for b, ((req, c), first) in enumerate(zip(chunks, out)) if first is not None]
        for b, row, req in ends:
            nxt[b, row] = req.last
            prompt = torch.tensor(req.prompt, device=self.device)
            # ext-only's window starts from the target's top-K_ver after the prompt
            first = None if self.vocab.use_prompt else t.topk(t.logits(h[b, row:row + 1]), self.k_ver)
            self.vocab.start(req.slot, prompt, torch.cat(self.topk_pre.pop(req.slot)), first)  # nothing of others
            self.vocab.join()  # before the next window's gather: one in flight at a time
        B, T = ids.shape
        # the draft's input feature: the target's hidden (EAGLE-2) or its three layers (EAGLE-3) of this pass
        dh = self.draft.hidden(nxt.flatten(), self.draft.features(h).flatten(0, 1), self.positions(slots),
                               slots.flatten(), span, cache=self.dcache).view(B, T, -1)
        for b, row, req in ends:
            self.h_last[req.slot] = dh[b, row]
        return out

    def step(self, chunks: list[tuple], decodes: list) -> tuple[list[list[int] | None], list[list[int]]]:
        """The prompt chunks' pass, then the round of the requests past their prompts."""
        return self.prefill(chunks) if chunks else [], self.decode(decodes) if decodes else []

    def plan(self, reqs: list) -> int:
        """The policy's shape for this step's decoding requests; returns the target rows each of them adds."""
        # under --tp rank 0's choice (it rests on each rank's own timings): every rank runs the same shape
        self.planned = parallel.agree(self.policy.choose(reqs, batch_bucket(len(reqs), self.max_batch)), self.device)
        tree = self.shapes[self.planned]
        return tree.total_tokens if tree else 1

    def decode(self, reqs: list) -> list[list[int]]:
        """One step for the batch in the planned shape: a draft / verify / update round, or plain decode rows
        (the root alone: verified, the window and the draft's state carried on as after a round)."""
        B = len(reqs)
        Bb = batch_bucket(B, self.max_batch)
        shape = parallel.agree(self.policy.choose(reqs, Bb), self.device) if self.planned is None else self.planned
        self.planned = None
        # the batched draft head multiplies slots 0 .. top-1 in place (vocab/batched.py): top covers every slot
        top = batch_bucket(max(r.slot for r in reqs) + 1, self.max_batch)
        t0 = time.perf_counter()
        S, mode = self.prepare(reqs, Bb)
        self.launch((shape, Bb, top, S, mode), lambda: self._round(shape, Bb, top, S, mode))
        res = self.out[:B].tolist()  # the one host read per round
        self.policy.observe(reqs, shape, Bb, [row[0] + 1 for row in res], time.perf_counter() - t0)
        size_of = self.shapes[shape].total_tokens if self.shapes[shape] else 1
        out = []
        for r, (k, size, covered, *emitted) in zip(reqs, res):
            s = r.stats
            s.tree_sizes[size_of] = s.tree_sizes.get(size_of, 0) + 1
            if size_of > 1:  # speculative rounds only: a plain step's one token is no acceptance
                s.rounds += 1
                s.round_tokens += k + 1
                s.vocab_sum += size
                s.vocab_max = max(s.vocab_max, size)
                s.covered += covered
            r.n += k + 1
            r.last = emitted[k]
            out.append(emitted[:k + 1])
        return out

    def measure(self, shape: int, Bb: int) -> float:
        """Seconds of one step of `shape` over Bb padding rows (the policy's cost calibration): the same launch,
        bucket and host read as a real step, on CUDA through its captured graph (captured here, so the first real
        step of the bucket replays it). Padding rows write only the pool's block 0 and change no window."""
        self.inp[:, :Bb].copy_(torch.tensor([0, 0, self.pad], device=self.device)[:, None].expand(3, Bb))
        S = bucket_for(self.reserve, self.target.cfg.max_seq_len) if self.graphs else self.reserve
        mode = self.sampler.mode([self.pad])
        key = (shape, Bb, Bb, S, mode)
        times = []
        for i in range(5 if self.graphs else 3):  # CUDA: eager, capture, then 3 timed replays; CPU: 1 warm-up
            t0 = time.perf_counter()
            self.launch(key, lambda: self._round(shape, Bb, Bb, S, mode))
            self.out[:1].tolist()
            times.append(time.perf_counter() - t0)
        return min(times[2 if self.graphs else 1:])

    def calibrate(self) -> None:
        """Every (shape, rows bucket) the policy may weigh, measured now (start-up on CUDA: graphs captured)."""
        if self.policy.policy == "fixed":
            return
        Bb = 1
        while True:
            for shape in range(len(self.shapes)):
                self.policy.costs(shape, Bb)
            if Bb >= self.max_batch:
                break
            Bb = batch_bucket(Bb + 1, self.max_batch)

    def _round(self, shape: int, Bb: int, top: int, S: int, mode: str) -> None:
        t, d, vocab, cfg, dev = self.target, self.draft, self.vocab, self.shapes[shape], self.device
        root, n, slots = self.inp[0, :Bb], self.inp[1, :Bb], self.inp[2, :Bb]
        table = self.table.index_select(0, slots)
        if cfg is None:  # plain rows: the root alone, a tree of one node
            P = 1
            zero = self.steps[:1].expand(Bb)[:, None]  # a view: no kernel
            tree = Tree(tokens=root[:, None], parent=zero, depth=zero, anc=self.one.expand(Bb, 1, 1))
        else:
            P = cfg.max_path
            temperature = self.sampler.draft_temperature(slots, mode)  # [Bb, 1]
            temperature = None if temperature is None else temperature[:, None]  # over a row's [T, d] hidden

            head = vocab.head_for(slots, top)  # each request through its own vocabulary, the batch in one GEMM

            def heads(h, k):
                return head(tempered(d.head_in(h), temperature), k)

            tree = draft_trees(d, self.dcache, heads, self.h_last[slots], root, n, table, S, cfg)
        steps = self.steps[:P]
        hid, logits = verify(t, self.cache, tree, n, table, S)
        N, V = tree.tokens.shape[1], logits.shape[-1]
        # greedy rows: the argmax of every node; sampling rows: one draw per node with the uniform of its position
        # (a greedy step keys no uniform: its rows and positions are not made)
        rows = pos = None
        if mode != "greedy":
            rows, pos = slots[:, None].expand(Bb, N).flatten(), (n[:, None] + 1 + tree.depth).flatten()
        choice = self.sampler.choose(logits.view(Bb * N, V), rows, pos, mode)
        # the target's top-K_ver ids for the window (none for a shared vocabulary, nor ctx-only's frozen window);
        # a padding row adds nothing to the padding slot's window
        real = (slots != self.pad)[:, None] if vocab.takes_ids else None
        if cfg is None:  # plain: the root's token; its verified ids wait for the request's next round
            path = k = self.steps[:1].expand(Bb)  # zero
            path, emitted = path[:, None], choice.view(Bb, 1)
            size = covered = k
            if real is not None:
                ver = t.topk(logits[:, 0], self.k_ver)  # (under --tp: over the ranks' vocabulary slices)
                vocab.defer(slots, torch.where(real, ver, -1))
        else:
            path, k, emitted = accept(tree, choice.view(Bb, N), P)
            valid = steps[None, :] <= k[:, None]
            size = vocab.size(slots)
            covered = (vocab.contains(slots, emitted) & valid).sum(1)
            # the accepted path's KV to the committed slots: the physical slots of n + path and n + steps at once
            moved = physical(table, n[:, None] + torch.cat([path, steps.expand(Bb, P)], 1))
            self.cache.move(moved[:, :P], moved[:, P:])  # [Bb, P] each: an index of any shape
            if real is not None:
                ver = t.topk(logits.gather(1, path[:, :, None].expand(Bb, P, V)).flatten(0, 1), self.k_ver)
                ver = torch.where((valid & real)[:, :, None], ver.view(Bb, P, -1), -1).flatten(1)
                # the gathers run on the copy stream, behind the draft forward
                vocab.update(slots, torch.where(real, tree.tokens[:, 1:], -1), ver)
        feat = d.features(hid)  # [Bb, N, d] the target's hidden (EAGLE-2) or [Bb, N, 3 d] its layers (EAGLE-3)
        if cfg is None:  # the root alone: its position n, its feature the only one
            pos, hid_path = n, feat.flatten(0, 1)
        else:
            pos = (n[:, None] + steps).flatten()
            hid_path = feat.gather(1, path[:, :, None].expand(Bb, P, feat.shape[-1])).flatten(0, 1)
        h = d.hidden(emitted.flatten(), hid_path, pos, pos, Span(n, causal_mask(P, dev).expand(Bb, P, P), S, table),
                     cache=self.dcache).view(Bb, P, -1)
        self.h_last[slots] = h[:, 0] if cfg is None else h.gather(1, k[:, None, None].expand(Bb, 1, h.shape[-1]))[:, 0]
        vocab.join()
        self.out[:Bb, :3 + P].copy_(torch.cat([k[:, None], size[:, None], covered[:, None], emitted], 1))
