"""The model runner of the batched engine: a paged KV pool, per-request device state in batch slots, and one
target pass per step for the whole batch: the prompt chunks of the requests being prefilled and one decode row per
running request together (`step`), under the scheduler's token budget.

Each running request holds a batch slot: its row of the block table lives on the device from join to leave (the
blocks of an AR request are appended as it grows). A decode-only step's inputs (last token, committed length, slot
of each row) are copied from the host into one persistent buffer, so the step itself has no host reads; on CUDA it
is captured in a graph per (batch-size bucket, span bucket, sampling mode) and replayed. Rows past the real batch
(up to the batch-size bucket, on every device, so the CPU tests run what the graphs capture) are padding: a greedy
request of length 0 in the padding slot, whose table points at the pool's block 0 (never handed out). A step with
prompt chunks packs its rows (`pack`, shared by AR and the speculative runner): each chunk attends as its own Span,
the decode rows as one (plugins/layers.py Spans; on CUDA one attention launch a layer for all of them). Packed
passes of up to GRAPHED_ROWS rows (AR's step, the speculative runner's target + draft pass) are padded to a rows
bucket and, on CUDA, replayed through a graph per bucket (on every device padded alike); larger ones run eagerly
with no padding rows. The speculative runner (engine/spec_runner.py) is this runner with a draft, its rounds and its
speculation policy.

Sampling: each batch slot is a row of one Sampler (speculative/sampling.py), set when a request joins, with the key of
its seed; the uniform of a token is a hash of that key and the token's position, computed inside the step, so a
request's tokens are those it gets alone with the same SamplingParams and seed, whatever the batch, the step's tree
or a preemption (recomputed, its tokens keep their positions).
"""
from __future__ import annotations

import array
import heapq
import itertools
import os
from dataclasses import dataclass

import torch

from plugins.layers import KV_BLOCK, varlen_layout

from .. import parallel
from ..models.model import KVCache, ModelConfig, Span, Spans, Transformer
from ..models.registry import UserError
from ..speculative.sampling import Sampler
from ..speculative.tree import TreeConfig, causal
from .block_manager import BlockManager, block_bytes, check_fits, pool_blocks
from .graphs import GraphRunner, bucket_for

DEFAULT_KV_MEMORY = {"cuda": 0.5, "cpu": 0.5}  # fraction of free GPU memory / GiB on the CPU
# tokens of target work per step (prompt chunks + decode rows): a GPU step at 8k rows is GEMM-bound (vLLM chunks at
# 8k-16k); on the CPU a smaller pass keeps the running requests' inter-token latency bounded
DEFAULT_MAX_NUM_TOKENS = {"cuda": 8192, "cpu": 1024}
PREFILL_CHUNK = 512  # prompt rows per LM-head call when collecting top-K_pre (never [L x V] at once)
# Packed passes of up to GRAPHED_ROWS rows replay a CUDA graph per rows bucket (multiples of PACKED_BUCKET): under
# continuous joins most steps carry a small prompt chunk beside the decode rows, and eagerly such a step is bound by
# its ~300 launches (H200, AR at c = 64 under joins: 17.6 ms a step eagerly, 4.1 ms graphed; 20-40 us of host time
# a launch). Larger passes are bound by their GEMMs and stay eager. MICROSPEC_PACKED_GRAPHS=0: every packed pass eager
GRAPHED_ROWS = 2048
PACKED_BUCKET = 128
GRAPH_BLOCK_M = 64  # a graphed pass's attention tile height (triton_layers.varlen_plan's for long sequences)


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


@dataclass
class Packed:
    """One packed pass's inputs on the device (BatchRunner.pack)."""
    tokens: torch.Tensor  # [L]: the chunks' tokens, then each decode's last token
    slots: torch.Tensor  # [L]: each row's logical slot (its position)
    spans: Spans  # one Span per chunk, then one for the decode rows
    rows: torch.Tensor  # the rows whose next token is sampled: each completed prompt's last, then every decode row
    slot: torch.Tensor  # the batch slot of each sampled row
    at: torch.Tensor  # the position of each sampled token
    sample: list[int]  # the same batch slots on the host (the sampling mode)
    ends: list[int]  # the chunks that complete their prompt in this pass
    extra: list[torch.Tensor]  # pack's `extra` host tensors, on the device


def longs(xs: list[int]) -> torch.Tensor:
    """A host int64 tensor of a list of ints, through array.array: torch.tensor on a Python list costs ~10x more
    (a packed pass's 8k token ids: milliseconds of every step's host time)."""
    return torch.frombuffer(array.array("q", xs), dtype=torch.long) if xs else torch.zeros(0, dtype=torch.long)


def upload(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for the GPU: a plain copy from pageable memory synchronizes the
    stream (torch), so an overlapped step (Scheduler overlap) would wait for the step in flight. Pinned, the copy is
    queued behind it (the caching host allocator keeps the pinned block until the copy has run)."""
    return host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host


def batch_bucket(B: int, max_batch: int) -> int:
    b = 1
    while b < B:
        b *= 2
    return min(b, max_batch)


class BatchRunner:
    grows = True  # blocks are appended as a request grows (and it may be preempted, then recomputed)
    inputs = 3  # rows of the persistent input buffer `inp`: last token, committed length, batch slot

    def __init__(self, target: Transformer, max_batch: int, kv_memory: float | None = None,
                 cuda_graphs: bool = False, draft_cfg: ModelConfig | None = None, reserve: int = 1,
                 max_num_tokens: int | None = None, slot_bytes: int = 0,
                 prefix_cache: bool = False):
        """slot_bytes: bytes a caller keeps per pool slot beside the KV (SpecRunner.prompt_rows), so the
        pool's budget counts them. prefix_cache: a joining request takes the KV of its prompt's start from the blocks
        earlier requests left (block_manager.py), where `shares_prefix` lets it."""
        c, dev, dtype = target.cfg, target.cache.k.device, target.cache.k.dtype
        self.target, self.max_batch, self.device = target, max_batch, dev
        self.stop_ids = list(c.eos_ids)
        self.reserve = reserve  # slots a step writes past the committed length
        # the step's token budget: prompt chunks and plain decode rows, AR's and a speculative method's alike. A
        # tree's round is a pass of its own (its requests' trees, max_batch x the tree's rows at most): it takes
        # the budget from that step's prompt chunks (Scheduler) but never raises it, so that a speculative engine
        # whose requests decode plainly packs its prompts as AR's does (a budget of max_batch x 60 rows let its
        # steps carry 15,360 prompt rows at 256 requests where AR's carry 8,192: ITL p99 79.5 vs 44.2 ms, H100)
        self.max_num_tokens = max_num_tokens or max(DEFAULT_MAX_NUM_TOKENS[dev.type], max_batch)
        if self.max_num_tokens < max_batch:
            raise UserError(f"max_num_tokens {self.max_num_tokens} is below max_batch {max_batch} (every running "
                            f"request decodes a row each step): raise it or lower max_batch")
        kv_memory = kv_memory or DEFAULT_KV_MEMORY[dev.type]
        # a block of the target's pool and, with draft_cfg, of the draft's (SpecRunner: it shares the block ids, one
        # table for both), each in its own KV shape
        self.block_bytes = sum(block_bytes(cfg, dtype) for cfg in (c, draft_cfg) if cfg is not None) \
            + slot_bytes * KV_BLOCK
        # table columns: every span (a chunk's, a step's S bucket) reaches at most max_seq_len
        width = -(-c.max_seq_len // KV_BLOCK)
        # the per-slot buffers grow with max_batch: the block table (int64) is the largest
        check_fits(f"the block table of max_batch {max_batch}", (max_batch + 1) * width * 8, dev)
        # under --tp every rank schedules alike: the same pool on each (the smallest of their free memories)
        self.blocks = BlockManager(parallel.agree(pool_blocks(kv_memory, self.block_bytes, dev), dev, "min"),
                                   -(-c.max_seq_len // KV_BLOCK), prefix_cache)
        self.cache = KVCache(c, c.num_layers, dtype, dev, slots=self.blocks.num_blocks * KV_BLOCK)
        # one table row per batch slot, plus the padding slot (all block 0)
        self.table = torch.zeros(max_batch + 1, width, dtype=torch.long, device=dev)
        self.pad = max_batch
        # a heap: a request takes the lowest free slot, so the running ones stay packed at the front (the
        # batched MicroSpec draft head runs over slots 0 .. the highest one in use)
        self.free_slots = list(range(max_batch))
        self.joined: list[int] = []  # slots joined since the last map_blocks, their table rows to clear
        self.joined_blocks: list[tuple[int, int, int]] = []  # and the blocks they joined with (speculative)
        self.queued = 0  # requests waiting to join behind the batch, as the scheduler last saw them
        self.inp = torch.zeros(self.inputs, max_batch, dtype=torch.long, device=dev)
        self.next = torch.zeros(max_batch, dtype=torch.long, device=dev)
        # each batch slot's last sampled decode token, on the device: an overlapped step's input row of a request
        # whose token the host has not read yet (its `last` is -1) is taken from here (_decode)
        self.last_dev = torch.zeros(max_batch + 1, dtype=torch.long, device=dev)
        self.one = causal(1, dev)[None]
        self.sampler = Sampler(target.argmax, dev, max_batch + 1)  # a row per batch slot and the padding slot (greedy)
        self.graphs = GraphRunner() if cuda_graphs else None
        self.tri = causal(1, dev)  # the causal mask of the longest chunk so far: a chunk's mask is a view of it
        # packed passes of at most graph_rows rows run padded to their bucket (`_pass`; 0: none), their inputs in one
        # buffer per (rows bucket, sampled rows bucket) that its graph reads, their tokens into one beside it
        packed = cuda_graphs and os.environ.get("MICROSPEC_PACKED_GRAPHS", "1") != "0"
        self.graph_rows = min(GRAPHED_ROWS, self.max_num_tokens) if packed else 0
        # a graphed packed pass's input buffers per (rows bucket, sampled rows bucket, extra rows)
        self.static: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.G = c.num_heads // c.num_kv_heads
        # the head groupings (query heads a kv head) whose attention tile lists a graphed pass keeps: the target's,
        # and a draft's that attends over the same rows (SpecRunner.packed) if it groups its heads otherwise
        self.graph_G = [self.G] if draft_cfg is None else sorted({self.G, draft_cfg.num_heads // draft_cfg.num_kv_heads})

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        check_request(prompt, max_new_tokens, self.target.cfg.max_seq_len, self.target.cfg.vocab_size, self.reserve)

    def slots_for(self, prompt: list[int], max_new_tokens: int) -> int:
        """A request stops at max_seq_len whatever its budget (Scheduler: "length"), as on the single path."""
        return min(len(prompt) + max_new_tokens + self.reserve, self.target.cfg.max_seq_len)

    def shares_prefix(self, req) -> bool:
        """Whether req, joining now, may start from the prefix cache's blocks (AR: always)."""
        return True

    def join(self, req, blocks: list[int]) -> None:
        """req takes a batch slot; its table row is cleared and given `blocks` at the step's map_blocks (one copy
        to the device for every join and growth of the step, not one each)."""
        req.slot = heapq.heappop(self.free_slots)
        self.joined.append(req.slot)
        self.joined_blocks += [(req.slot, i, b) for i, b in enumerate(blocks)]
        self.sampler.start(req.slot, req.params, self.target.cfg.vocab_size)

    def map_blocks(self, updates: list[tuple[int, int, int]]) -> None:
        """The table rows of the slots joined since the last call cleared, then (batch slot, table column, block)
        of every block handed out this step written: one host -> device copy, two writes."""
        updates = self.joined_blocks + updates
        if not self.joined and not updates:
            return
        host = upload(longs(self.joined + [x for u in updates for x in u]), self.device)
        fresh, (slot, col, block) = host[:len(self.joined)], host[len(self.joined):].view(-1, 3).T
        if self.joined:
            self.table.index_fill_(0, fresh, 0)
        if updates:
            self.table.index_put_((slot, col), block)
        self.joined, self.joined_blocks = [], []

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

    def overlappable(self, chunks: list[tuple], decodes: list) -> bool:
        """Whether this step may be launched before the step in flight is read (Scheduler overlap; AR: always)."""
        return True

    def read(self, reqs: list, seconds: float | None) -> None:
        """The oldest overlapped step's tokens were emitted to `reqs`; it took `seconds` (Scheduler.drain; None:
        not known). AR keeps no statistics of its own."""

    def step(self, chunks: list[tuple], decodes: list) -> tuple[list[list[int] | None], list[list[int]]]:
        """One target pass: the next chunk of each (request, chunk length) being prefilled and one decode row per
        request of `decodes`. Returns each chunk's first token once its request's prompt is in (else None) and each
        decode's token. Without chunks, the (graph-captured) decode step."""
        if not chunks and not decodes:
            return [], []
        return self.advance(chunks, decodes, self._pass(chunks, decodes).tolist())  # the one host read of the step

    def _pass(self, chunks: list[tuple], decodes: list) -> torch.Tensor:
        """`step`'s target pass launched, nothing read: the sampled rows' tokens on the device (each chunk's that
        completes its prompt, then each decode's), also into last_dev, where an overlapped next step's decode rows
        read them. Without chunks, the (graph-captured) decode step."""
        if not chunks:
            Bb = batch_bucket(len(decodes), self.max_batch)
            S, mode = self.prepare(decodes, Bb)
            self.launch((Bb, S, mode), lambda: self._decode(Bb, S, mode))
            return self.next[:len(decodes)]
        pad = self.packed_pad(chunks, decodes)
        if pad:  # padded to its bucket, through the bucket's graph (GRAPHED_ROWS)
            p = self.pack(chunks, decodes, pad=pad)
            mode = self.sampler.mode(p.sample)
            out = self.static[(*pad, 0)][1]
            self.launch(("packed", *pad, mode), lambda: out.copy_(self._sample(p, mode)))
            return out[:len(p.sample)]
        p = self.pack(chunks, decodes)
        if not p.sample:
            self.target(p.tokens, self.positions(p.slots), p.slots, p.spans, cache=self.cache)
            return p.rows  # (empty: no row sampled)
        return self._sample(p, self.sampler.mode(p.sample))

    def packed_pad(self, chunks: list[tuple], decodes: list) -> tuple[int, int] | None:
        """The (rows, sampled rows) buckets of a packed pass that a CUDA graph replays, None for an eager one (more
        than graph_rows rows). The rows bucket is the next multiple of PACKED_BUCKET above the rows, so a padded
        pass always has a padding chunk: its last row is what the padded sampled rows read."""
        rows = sum(c for _, c in chunks) + len(decodes)
        if rows > self.graph_rows:
            return None
        R = sum(req.prefilled + c == req.seq_len for req, c in chunks) + len(decodes)
        return (rows // PACKED_BUCKET + 1) * PACKED_BUCKET, batch_bucket(R, self.max_batch)

    def _sample(self, p: Packed, mode: str) -> torch.Tensor:
        """The target's pass over a packed step's rows and a token for each sampled row (into last_dev too)."""
        h = self.target(p.tokens, self.positions(p.slots), p.slots, p.spans, cache=self.cache)
        tok = self.sampler.choose(self.target.logits(h[p.rows]), p.slot, p.at, mode)
        self.last_dev.index_copy_(0, p.slot, tok)
        return tok

    def pack(self, chunks: list[tuple], decodes: list, extra: list[torch.Tensor] = (),
             pad: tuple[int, int] | None = None) -> Packed:
        """The inputs of one packed pass (AR's step, SpecRunner's prompt pass): each chunk's rows, then one row per
        decode; each chunk attends as its own Span, the decode rows as one. Every index goes to the device in one
        host -> device copy, with the `extra` host tensors (a value per row: the draft's next tokens).
        pad (rows Mb, sampled rows Rb; packed_pad): a pass that a CUDA graph replays. Its rows are padded to Mb by
        one more chunk, at the padding slot from position 0 (its table row is block 0's, never handed out: its KV
        writes land there, and no other row reads them; `extra` is 0 there), its sampled rows to Rb (that chunk's
        last row, sampled into the padding slot), and every index it reads lies in one buffer per (Mb, Rb),
        attention's tile list for each head grouping of graph_G too (padded with empty tiles of an empty sequence,
        which return at once), so that the graph reads this step's."""
        dev, D = self.device, len(decodes)
        lens = [c for _, c in chunks]
        starts = [req.prefilled for req, _ in chunks]
        slots = [req.slot for req, _ in chunks]
        ids = []
        for req, c in chunks:
            ids += req.chunk(c)
        ends = [b for b, (req, c) in enumerate(chunks) if req.prefilled + c == req.seq_len]  # prompt done: a token
        real = len(ids)  # the chunks' rows
        if pad:
            assert pad[0] > real + D, "a padded pass has a padding chunk (packed_pad)"
            lens.append(pad[0] - real - D)
            starts.append(0)
            slots.append(self.pad)
            ids += [0] * lens[-1]
            extra = [torch.cat([x[:real], torch.zeros(lens[-1], dtype=x.dtype), x[real:]]) for x in extra]
        B = len(lens)
        ids += [r.last for r in decodes]
        P = len(ids) - D  # prompt rows
        offsets = list(itertools.accumulate(lens, initial=0))  # each chunk's first row
        rows = [offsets[b] + lens[b] - 1 for b in ends] + list(range(P, P + D))
        sample = [chunks[b][0].slot for b in ends] + [r.slot for r in decodes]
        # the position of each sampled token: after its prompt, or after its request's last token
        at = [starts[b] + lens[b] for b in ends] + [r.n + 1 for r in decodes]
        R = len(rows)
        # each row's logical slot (its position) and its batch slot (its row of the block table): the chunks'
        # rows, then the decodes'
        lens_t = longs(lens)
        pos = [torch.arange(P) + longs([starts[b] - offsets[b] for b in range(B)]).repeat_interleave(lens_t),
               longs([r.n for r in decodes])]
        row_table = [longs(slots).repeat_interleave(lens_t), longs([r.slot for r in decodes])]
        if pad is None:
            host = [longs(ids), *pos, *row_table, longs(starts + rows + sample + at), *extra]
            tokens, pos, row_table, n_chunk, rows_d, slot_d, at_d, *extra_d = upload(torch.cat(host), dev).split(
                [P + D, P + D, P + D, B, R, R, R, *(x.numel() for x in extra)])
            n_dec, table_dec = pos[P:], None
        else:
            Mb, Rb = pad
            NS = self.max_batch + 2  # sequences: a step's requests (a chunk or a decode each), the padding's, an empty one
            NT = [-(-Mb * G // GRAPH_BLOCK_M) + NS for G in self.graph_G]  # tiles: a partial row block a sequence
            none = NS - 1  # the empty sequence: (row 0, 0 rows), 0 committed slots
            seq_n = starts + [r.n for r in decodes]
            seq_slot = slots + [r.slot for r in decodes]
            seq_n += [0] * (NS - len(seq_n))
            seq_slot += [self.pad] * (NS - len(seq_slot))
            more = Rb - R  # sampled rows past R: the padding chunk's last row, into the padding slot
            host = [longs(ids), *pos, *row_table, *extra, longs(rows + [P - 1] * more + sample + [self.pad] * more +
                                                                at + [0] * more + seq_n + seq_slot)]
            for G, nt in zip(self.graph_G, NT):
                seqs, tiles = varlen_layout([(1, c) for c in lens] + [(D, 1)], G, GRAPH_BLOCK_M)
                seqs += [(0, 0)] * (NS - len(seqs))
                tiles += [(none, 0)] * (nt - len(tiles))
                host += [longs([x for st in seqs for x in st]), longs([x for t in tiles for x in t])]
            key = (Mb, Rb, len(extra))  # (a speculative runner's passes carry extra rows, its AR-like ones none)
            if key not in self.static:
                width = self.table.shape[1]
                size = (3 + len(extra)) * Mb + 3 * Rb + 2 * NS + sum(2 * NS + 2 * nt for nt in NT)
                self.static[key] = (torch.zeros(size, dtype=torch.long, device=dev),
                                    torch.zeros(Rb, dtype=torch.long, device=dev),
                                    torch.zeros(NS, width, dtype=torch.long, device=dev))
            buf, _, table_seq = self.static[key]
            host = torch.cat(host)
            buf.copy_(host.pin_memory() if dev.type == "cuda" else host, non_blocking=True)  # (as `upload`)
            parts = buf.split([Mb, Mb, Mb, *[Mb] * len(extra), Rb, Rb, Rb, NS, NS]
                              + [n for nt in NT for n in (2 * NS, 2 * nt)])
            tokens, pos, row_table = parts[:3]
            extra_d = list(parts[3:3 + len(extra)])
            rows_d, slot_d, at_d, seq_n_d, seq_slot_d, *layouts = parts[3 + len(extra):]
            torch.index_select(self.table, 0, seq_slot_d, out=table_seq)
            n_chunk, n_dec, table_dec = seq_n_d, seq_n_d[B:B + D], table_seq[B:B + D]
        if decodes and min(ids[P:]) < 0:  # overlap: a decode whose last (-1) the step in flight samples reads it
            tokens[P:] = torch.where(tokens[P:] >= 0, tokens[P:], self.last_dev.index_select(0, row_table[P:]))
        if max(lens) > self.tri.shape[0]:
            self.tri = causal(1 << (max(lens) - 1).bit_length(), dev)
        parts = [Span(n_chunk[b:b + 1], self.tri[None, :c, :c], starts[b] + c, self.table[slots[b]:slots[b] + 1])
                 for b, c in enumerate(lens)]
        if decodes:
            parts.append(Span(n_dec, self.one.expand(D, 1, 1), max(r.n for r in decodes) + 1,
                              self.table.index_select(0, row_table[P:]) if table_dec is None else table_dec))
        # causal: each part's mask is its rows' triangle (a chunk's, a decode's 1 x 1), so on CUDA attention runs
        # all parts in one launch a layer; the rows' table rows make their physical slots one gather
        spans = Spans(parts, causal=True, table=self.table, row_table=row_table)
        if pad:  # attention's tile lists, the graph's: in the step's buffer
            spans.block_m = GRAPH_BLOCK_M
            for G, seqs_d, tiles_d in zip(self.graph_G, layouts[::2], layouts[1::2]):
                spans._varlen[(G, GRAPH_BLOCK_M)] = (tiles_d.view(-1, 2), seqs_d.view(-1, 2), seq_n_d, table_seq)
        return Packed(tokens, pos, spans, rows_d, slot_d, at_d, sample, ends, extra_d)

    def advance(self, chunks: list[tuple], decodes: list, toks: list[int]):
        """The host side after a packed pass: each request past its chunk, the first token of each whose prompt is
        now in (else None), each decode past its token (toks: the sampled rows' tokens, in the pass's order)."""
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

    def positions(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.flatten().clamp(max=self.target.cfg.max_seq_len - 1)  # a padding row may pass the rotary table

    def prepare(self, reqs: list, rows: int, extra: list[list[int]] = ()) -> tuple[int, str]:
        """The host side of a step: each request's (last token, committed length, batch slot, then each list of
        `extra`) into the persistent input buffer, `rows` - len(reqs) padding rows after them (0 in `extra`'s
        rows). Returns the KV span S (a bucket under CUDA graphs) and the sampling mode: with the row count, what
        a step's graph is keyed by."""
        pad = rows - len(reqs)
        vals = [r.last for r in reqs] + [0] * pad + [r.n for r in reqs] + [0] * pad + \
            [r.slot for r in reqs] + [self.pad] * pad
        for e in extra:
            vals += e + [0] * pad
        k = 3 + len(extra)
        self.inp[:k, :rows].copy_(upload(longs(vals), self.device).view(k, rows))
        S = max(r.n for r in reqs) + self.reserve
        if self.graphs:
            S = bucket_for(S, self.target.cfg.max_seq_len)
        return S, self.sampler.mode([r.slot for r in reqs])

    def replays(self, key: tuple) -> bool:
        """Whether launch(key) replays a captured graph, or runs without graphs: its time is the step's own, not
        a first use's (an eager run, then a capture: 18-60 ms on the H200 where a step takes 2-4)."""
        return self.graphs is None or ("step", key) in self.graphs.graphs

    def launch(self, key: tuple, fn) -> None:
        """Run a step: eagerly, or through the CUDA graph of its key (greedy and sampling steps differ)."""
        if self.graphs:
            self.graphs.begin_round(key)
            self.graphs("step", key, fn)
        else:
            fn()

    def decode(self, reqs: list) -> list[list[int]]:
        """One AR step for the batch: one target pass over one row per request."""
        return self.step([], reqs)[1]

    def step_async(self, chunks: list[tuple], decodes: list) -> tuple[list[tuple], torch.Tensor, object]:
        """`step` launched, its tokens not read (Scheduler overlap): a request whose `last` is -1 (sampled by the
        step still in flight) takes its input token from the device (last_dev). Returns the sampled rows'
        (request, True for a prompt's first token) in the tokens' order, the tokens' host copy queued into pinned
        memory behind the pass, and the event that says it has landed (None on the CPU: it has). The requests are
        left as they are: the scheduler advances them."""
        if not chunks and not decodes:
            return [], torch.zeros(0, dtype=torch.long), None
        tok = self._pass(chunks, decodes)
        rows = [(req, True) for req, c in chunks if req.prefilled + c == req.seq_len] + [(r, False) for r in decodes]
        return self.launched(rows, tok)

    def launched(self, rows: list[tuple], tok: torch.Tensor) -> tuple[list[tuple], torch.Tensor, object]:
        """step_async's result: the sampled rows, their tokens' host copy queued behind the pass, its event."""
        if self.device.type != "cuda":
            return rows, tok.clone(), None
        host = torch.empty(tok.shape, dtype=tok.dtype, pin_memory=True)
        host.copy_(tok, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return rows, host, done

    def _decode(self, Bb: int, S: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The AR step (each row's token into self.next) -> the target's hidden [Bb, d] and logits [Bb, V]: a
        speculative runner's plain step is this step and what it keeps of them for its draft (SpecRunner._plain)."""
        tok, n, slot = self.inp[0, :Bb], self.inp[1, :Bb], self.inp[2, :Bb]
        tok = torch.where(tok >= 0, tok, self.last_dev.index_select(0, slot))  # -1: the step in flight's token
        span = Span(n, self.one.expand(Bb, 1, 1), S, self.table.index_select(0, slot))
        h = self.target(tok, n, n, span, cache=self.cache)
        logits = self.target.logits(h)
        self.next[:Bb].copy_(self.sampler.choose(logits, slot, n + 1, mode))
        self.last_dev.index_copy_(0, slot, self.next[:Bb])  # (padding rows all write the padding slot's)
        return h, logits
