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
with no padding rows.

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
import time
from collections import deque
from dataclasses import dataclass

import torch

from plugins.layers import KV_BLOCK, varlen_layout

from .. import parallel
from ..models.model import KVCache, ModelConfig, Span, Spans, Transformer
from ..models.registry import UserError
from ..speculative.batch_tree import accept, causal_mask, draft_trees, physical, verify
from ..speculative.sampling import Sampler, tempered
from ..speculative.tree import Tree, TreeConfig, causal
from ..vocab.batched import batch_vocab
from ..vocab.strategies import Window
from .block_manager import BlockManager, block_bytes, check_fits, pool_blocks
from .graphs import GraphRunner, bucket_for
from .policy import SpecPolicy, StepCosts, tree_shapes

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
# SpecRunner: plain steps a request may run before its draft catches up (its lag buffer's rows). A round's catch-up
# pass is padded to LAG rows a request, so a round has two variants (graphs), with and without one: with a bucket per
# lag (1, 2, 4, .. LAG), the `auto` policy's mix of shapes meets a new graph (an eager run, then a capture) far more
# often (on the H200 its summarization turn took 0.64 s where `fixed`'s took 0.36 s, ~0.3 s past its steps' costs).
# A draft pass over 16 rows a request costs what one over 1 does at small batches (it reads the layer's weights once)
LAG = 16


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
                 max_num_tokens: int | None = None, decode_rows: int = 1, slot_bytes: int = 0,
                 prefix_cache: bool = False):
        """slot_bytes: bytes a caller keeps per pool slot beside the KV (SpecRunner.prompt_rows), so the
        pool's budget counts them. prefix_cache: a joining request takes the KV of its prompt's start from the blocks
        earlier requests left (block_manager.py; AR's pool alone: a speculative request's window and draft state
        start from its whole prompt)."""
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
                                   -(-c.max_seq_len // KV_BLOCK), prefix_cache and self.grows)
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


class SpecRunner(BatchRunner):
    """Batched EAGLE-2 rounds (every speculative method: eagle, frspec, the MicroSpec windows and their
    ablations) with an EAGLE-1/2 or EAGLE-3 head: every request drafts its own tree through its own draft
    vocabulary, one target pass verifies all trees, acceptance and KV compaction per request. make_vocab's
    vocabulary becomes the batch's (vocab/batched.py): shared full/static rows, or a MicroSpec window (ring, counts,
    active ids, packed head rows) per batch slot, reset when a request joins. Each step runs the shape the
    speculation policy picks (engine/policy.py): a tree, or plain rows (AR's step; the window's ids deferred, the
    draft's rows kept in a lag buffer for the request's next round). A decode-only step is one device step with no
    host read but the one of its results, captured in a CUDA graph per (shape, rows bucket, head slots bucket, span
    bucket, sampling mode, catch-up rows bucket); padding rows leave every window as it is. A plain decode-only
    step, like AR's, may be launched before the step in flight is read (Scheduler overlap: `overlappable`); a round
    or a pass with prompt chunks reads it first. The draft is called through `draft.cfg` (the shapes of the KV
    pool allocated for it), `draft.hidden(tokens, features, positions, slots, span, cache=)`, `draft.features(h)`
    (its input feature from the target's pass that gave h: the hidden itself, EAGLE-3 its three tapped layers) and
    `draft.head_in(h)` (the vocabulary head's input) only. A step with prompt chunks packs them as AR does (BatchRunner.pack, no padding
    rows, under the token budget alone; graphed up to graph_rows) and runs the draft over the same rows, and the
    LM head's top-K_pre over them; a request that joins a batch too big for any tree to pay decodes as AR's
    (`_admit`), and a step of such requests alone is AR's step; when the
    step's shape is plain, the decode rows go into the same target and draft pass; a tree's round runs after the
    chunks' pass. A request's blocks are all taken when it joins: its window and draft state could not be
    recomputed token for token after a preemption, so none is preempted."""

    grows = False
    inputs = 4  # BatchRunner's rows, then each row's lag (its pending plain steps)

    def __init__(self, target: Transformer, draft, vocab, tree: TreeConfig, k_pre: int, k_ver: int,
                 max_batch: int, kv_memory: float | None = None, cuda_graphs: bool = False,
                 max_num_tokens: int | None = None, spec_policy: str = "auto", costs: StepCosts | None = None,
                 k_tree: int = 0):
        """spec_policy: auto (engine/policy.py: each step's tree from the step's cost and the requests' acceptance)
        or fixed (always `tree`); costs: the policy's cost model (None: measured by timing padding rounds).
        k_tree: a MicroSpec window also takes the target's top-k_tree ids at every verified tree node (see _round)."""
        shapes = tree_shapes(tree, spec_policy)
        window_pre = isinstance(vocab, Window) and vocab.use_prompt  # it keeps prompt_rows (below)
        super().__init__(target, max_batch, kv_memory, cuda_graphs, draft_cfg=draft.cfg,
                         reserve=max(round_reserve(t) for t in shapes if t),
                         max_num_tokens=max_num_tokens, decode_rows=tree.total_tokens,
                         slot_bytes=(1 + k_pre) * 8 if window_pre else 0)
        self.draft, self.tree, self.k_pre, self.k_ver, self.k_tree = draft, tree, k_pre, k_ver, k_tree
        self.shapes = shapes
        self.policy = SpecPolicy(shapes, spec_policy, costs or StepCosts(self.measure))
        self.planned: int | None = None  # the shape the scheduler planned this step's budget with
        dev = self.device
        # the draft's own KV pool, with the target's block ids (draft.cfg: its layers and KV shapes)
        self.dcache = KVCache(draft.cfg, draft.cfg.num_layers, self.cache.k.dtype, dev, slots=self.cache.pos.numel())
        self.vocab = batch_vocab(vocab, max_batch + 1)  # the padding slot too: padding rows read it
        if hasattr(self.vocab, "reset"):  # every slot a valid (pinned ids) window: a padding row may read a free one
            self.vocab.reset(torch.arange(max_batch + 1, device=dev))
        self.h_last = torch.zeros(max_batch + 1, draft.cfg.hidden_size, dtype=self.cache.k.dtype, device=dev)
        self.steps = torch.arange(tree.max_path, device=dev)
        self.steps_lag = torch.arange(LAG, device=dev)
        # only a MicroSpec window that starts from its prompt reads top-K_pre: the others skip the LM head over
        # every prompt row (shared rows: eagle, frspec; ext-only starts from the first token's top-K_ver)
        self.window_pre = window_pre
        self.spec_out: dict[tuple[int, int], torch.Tensor] = {}  # a graphed packed pass's tokens and top-K_ver
        # each pool slot's prompt id and top-K_pre ids, written by the pass that prefills the slot: the windows a
        # pass starts gather their prompts' rows through the block table at once, however many chunks each took
        # (a request's blocks hold its rows until it leaves; k_pre + 1 longs a slot beside its KV's kilobytes)
        self.prompt_rows = torch.full((self.cache.pos.numel(), 1 + k_pre), -1, dtype=torch.long, device=dev) \
            if self.window_pre else None
        # what the host reads after a round, per row: accepted k, vocabulary size, covered, emitted tokens
        self.out = torch.zeros(max_batch, 3 + tree.max_path, dtype=torch.long, device=dev)
        # The lazy draft: a plain step is AR's step (BatchRunner._decode, or a decode row beside prompt chunks) and
        # leaves the draft alone; it keeps, per batch slot, the target's feature of its row and the token it emitted
        # (the draft's input of the catch-up row the step would have run) in a lag buffer, at the row's index `lag`.
        # A request's next round (or a plain step that finds some buffer full) first runs the draft over its
        # pending rows in one causal pass (`_catch_up`): the draft's KV at those positions and h_last as the
        # per-step catch-up makes them. LAG <= reserve: a catch-up's padding rows (past a row's lag) write draft KV
        # slots at most `reserve` past the committed length, which the round overwrites before reading (as a tree's
        # expansions).
        self.lag_max = max(1, min(LAG, self.reserve))
        taps = getattr(draft, "taps", None)  # EAGLE-3: its features are the target's tapped layers, side by side
        fdim = target.cfg.hidden_size * (len(taps) if taps else 1)
        self.lag_feat = torch.zeros(max_batch + 1, self.lag_max, fdim, dtype=self.cache.k.dtype, device=dev)
        self.lag_tok = torch.zeros(max_batch + 1, self.lag_max, dtype=torch.long, device=dev)
        # and the step's verified top-K_ver ids, which join the window's deferred ids (vocab.defer) at the catch-up
        self.lag_ver = torch.full((max_batch + 1, self.lag_max, k_ver), -1, dtype=torch.long, device=dev)
        self.lags = [0] * (max_batch + 1)  # per batch slot on the host: its pending rows (the device reads inp[3])
        # each overlapped step in flight, oldest first (`read`): why it runs plain, its rows bucket, and whether its
        # time is a plain step's cost (not a graph's first use, nor a step of requests that decode as AR's)
        self.whys: deque[tuple[str, int, bool]] = deque()
        self.calibrated = False  # every step cost the policy weighs measured (calibrate): prompts_pay may use them
        # per batch slot: whether its request speculates (decided at its prompt's first pass: `_admit`), None: not yet
        self.speculates: list[bool | None] = [None] * (max_batch + 1)

    def join(self, req, blocks: list[int]) -> None:
        super().join(req, blocks)
        self.lags[req.slot] = 0
        self.speculates[req.slot] = None

    def _admit(self, chunks: list[tuple]) -> None:
        """Whether each request whose prompt starts this step speculates: not where the batch it joins is too big
        for any tree to pay (prompts_pay). Such a request decodes as AR's to its end -- AR's passes, its draft never
        run, no window, no lag buffer -- so that a batch of them costs what AR's costs (at 64 and 256 requests on
        the H100 the draft's prompt pass, lag buffers and catch-ups made microspec 0.67x / 0.90x AR while every
        step but probes ran plain). Decided once: a request never speculates later, when its batch shrinks."""
        new = [req for req, _ in chunks if self.speculates[req.slot] is None]
        if new:
            pay = self.prompts_pay()
            for req in new:
                self.speculates[req.slot] = req.stats.speculative = pay

    def _as_ar(self, chunks: list[tuple], decodes: list) -> bool:
        """Whether every request of this step decodes as AR's (`_admit`): then the step is AR's own."""
        self._admit(chunks)
        return all(self.speculates[r.slot] is False for r in [req for req, _ in chunks] + decodes)

    def _choose(self, reqs: list, Bb: int) -> int:
        """The policy's shape for a decode step of `reqs`: plain where any of them decodes as AR's (one shape a
        step), and why ("cost": it joined where no tree paid)."""
        if any(self.speculates[r.slot] is False for r in reqs):
            self.policy.why = "cost"
            return 0
        return parallel.agree(self.policy.choose(reqs, Bb), self.device)

    def step(self, chunks: list[tuple], decodes: list) -> tuple[list[list[int] | None], list[list[int]]]:
        """Without chunks, the (graph-captured) round of the planned shape. With chunks, one packed target pass and
        one draft pass over them, the decode rows in it too when the planned shape is plain; a planned tree's round
        runs after that pass (its verify rows are not merged into the packed pass: a tree's anc mask would be one
        more Span part, not done yet)."""
        if self._as_ar(chunks, decodes):  # AR's step, its statistics as a plain step's
            self.planned = None
            firsts, decoded = BatchRunner.step(self, chunks, decodes)
            for r in decodes:
                self.count_step(r.stats, 1, "cost")
            return firsts, decoded
        if not chunks:
            return [], self.decode(decodes) if decodes else []
        if decodes and self.planned is None:
            self.plan(decodes)
        if decodes and self.shapes[self.planned] is None:
            self.planned = None
            return self.packed(chunks, decodes)
        return self.packed(chunks, [])[0], self.decode(decodes) if decodes else []

    def packed(self, chunks: list[tuple], decodes: list) -> tuple[list[list[int] | None], list[list[int]]]:
        """One target pass and one draft pass over the packed chunks and plain decode rows (`_packed`), replayed
        from a CUDA graph per (rows bucket, sampled rows bucket, sampling mode) up to graph_rows rows, as AR's. Then,
        eagerly (their sizes vary), the windows of every prompt the pass completes start together, from their
        prompts and top-K_pre. The decode rows are plain steps as a decode-only one's: each one's draft row (its
        feature, token and top-K_ver) joins its lag buffer for its request's next round (a full buffer is caught
        up first, eagerly)."""
        lags = [self.lags[r.slot] for r in decodes]
        if decodes and max(lags) == self.lag_max:
            self.catch_up(decodes)
            lags = [0] * len(decodes)
        nxt = []
        for req, c in chunks:
            after = req.prompt[req.prefilled + 1:req.prefilled + c + 1]  # one short at the prompt's end
            nxt += after + [0] * (c - len(after))
        # top-K_pre where a prompt of the pass speculates (a pass of those that do not is AR's: `step`)
        pre = self.window_pre and any(self.speculates[req.slot] for req, _ in chunks)
        pad = self.packed_pad(chunks, decodes)
        # per row: the draft's next token (a prompt's), and a decode row's lag + 1 (0: a prompt's row)
        p = self.pack(chunks, decodes, [longs(nxt + [0] * len(decodes)),
                                        longs([0] * len(nxt) + [x + 1 for x in lags])], pad=pad)
        mode, R = self.sampler.mode(p.sample), len(p.sample)
        if pad:
            if pad not in self.spec_out:
                self.spec_out[pad] = torch.zeros(pad[1], 1 + self.k_ver, dtype=torch.long, device=self.device)
            out = self.spec_out[pad]
            self.launch(("spec-packed", *pad, mode, pre), lambda: out.copy_(self._packed(p, mode, pre)))
        else:
            out = self._packed(p, mode, pre)
        tok, ver = out[:R, 0], out[:R, 1:]
        if p.ends:  # the windows of every prompt this pass completes start together
            n = len(p.ends)
            if self.window_pre:  # the prompts' rows from the pool slots the passes wrote them to
                lens = [len(chunks[b][0].prompt) for b in p.ends]
                prompt, topk = self.prompts(p.slot[:n], upload(longs(lens), self.device), max(lens))
            else:
                prompt, topk = None, None
            self.vocab.start(p.slot[:n], prompt, topk, None if self.vocab.use_prompt else ver[:n])
        self.vocab.join()  # the new windows' packed rows, gathered on the copy stream
        # (no policy.observe: the step's time is mostly its chunks', not a plain step's cost)
        for r, lag in zip(decodes, lags):  # a plain step's one token is no acceptance: its size and why only
            self.lags[r.slot] = lag + 1 if self.speculates[r.slot] else 0  # (one decoding as AR's never catches up)
            self.count_step(r.stats, 1)
        return self.advance(chunks, decodes, tok.tolist())  # the one host read of the step

    def prompts_pay(self) -> bool:
        """Whether the requests whose prompts start now speculate (`_admit`): not where the batch they join -- the
        running requests and those queued behind them (`queued`, the scheduler's), up to max_batch -- is too big
        for any tree to pay at the calibrated costs (policy.pays). Only with the costs calibrated (calibrate: at
        start-up on CUDA); without (the CPU's, measured on first need by timings that vary run to run), every
        request speculates."""
        if not self.calibrated:
            return True
        n = min(self.max_batch, self.max_batch - len(self.free_slots) + self.queued)
        return bool(parallel.agree(int(self.policy.pays(n, batch_bucket(n, self.max_batch))), self.device))

    def _packed(self, p: Packed, mode: str, pre: bool = True) -> torch.Tensor:
        """`packed`'s device work, what its graph replays: the target's pass, every row's top-K_pre into
        prompt_rows (-1 without `pre`: prompts_pay; a decode's or padding row's lands at its own pool slot, past
        any prompt: never read), each sampled row's token and top-K_ver, and the draft's pass. The draft at row i
        reads the target's feature there and token i + 1: the prompt's next one, or its first token sampled in
        this pass at its last row, so a chunk needs nothing from the next one; that row's draft hidden starts the
        request's first round (h_last). A decode row is a plain step (`_plain`): its feature, token and top-K_ver
        go to its lag buffer at its lag (extra[1] - 1); the draft pass's output there is not used (its draft KV is
        rewritten by the catch-up). Returns [sampled rows, 1 + k_ver]: each one's token, then its top-K_ver."""
        t, d = self.target, self.draft
        h = t(p.tokens, self.positions(p.slots), p.slots, p.spans, cache=self.cache)
        feat = d.features(h)  # the target's hidden (EAGLE-2) or its three layers (EAGLE-3) of this pass
        if self.window_pre:  # every row's top-K_pre, PREFILL_CHUNK rows per LM-head call (never [rows x V])
            M = p.tokens.numel()
            top = torch.cat([t.topk(t.logits(h[i:min(i + PREFILL_CHUNK, M)]), self.k_pre)
                             for i in range(0, M, PREFILL_CHUNK)]) if pre else p.tokens.new_full((M, self.k_pre), -1)
            self.prompt_rows.index_copy_(0, p.spans.physical(p.slots), torch.cat([p.tokens[:, None], top], 1))
        if not p.rows.numel():  # (an eager pass that completes no prompt and has no decode rows)
            tok = logits = None
        else:
            logits = t.logits(h[p.rows])
            tok = self.sampler.choose(logits, p.slot, p.at, mode)
        nxt = p.extra[0] if tok is None else p.extra[0].index_copy(0, p.rows, tok)
        dh = d.hidden(nxt, feat, self.positions(p.slots), p.slots, p.spans, cache=self.dcache)
        if tok is None:
            return torch.zeros(0, 1 + self.k_ver, dtype=torch.long, device=self.device)
        lag1 = p.extra[1].index_select(0, p.rows)
        dec = lag1 > 0  # a decode row (else a prompt's last row, or padding): the other kind writes the padding slot
        self.h_last.index_put_((torch.where(dec, self.pad, p.slot),), dh[p.rows])
        ver = t.topk(logits, self.k_ver)
        self._keep((torch.where(dec, p.slot, self.pad), (lag1 - 1).clamp(min=0)), feat[p.rows], tok, logits, ver)
        return torch.cat([tok[:, None], ver], 1)

    def prompts(self, slots: torch.Tensor, lens: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts [B, L] and their rows' top-K_pre ids [B, L * k_pre], -1 padded, of the requests in batch
        slots `slots` (prompt lengths `lens`, L the longest), read from the pool slots of their rows (prompt_rows):
        a few ops for the whole batch, whatever the passes that wrote each row."""
        B = slots.numel()
        cols = torch.arange(L, device=self.device)
        rows = self.prompt_rows[physical(self.table.index_select(0, slots), cols.expand(B, L))]  # [B, L, 1 + k_pre]
        rows = torch.where((cols < lens[:, None])[..., None], rows, -1)  # past a prompt: another's rows, or none
        return rows[..., 0], rows[..., 1:].flatten(1)

    def plan(self, reqs: list) -> int:
        """The policy's shape for this step's decoding requests; returns the target rows each of them adds."""
        # under --tp rank 0's choice (it rests on each rank's own timings): every rank runs the same shape
        self.planned = self._choose(reqs, batch_bucket(len(reqs), self.max_batch))
        tree = self.shapes[self.planned]
        return tree.total_tokens if tree else 1

    def decode(self, reqs: list) -> list[list[int]]:
        """One step for the batch in the planned shape: a draft / verify / update round, or plain decode rows
        (AR's step, the draft's catch-up rows kept for the next round: `_plain`)."""
        shape, Bb, t0 = self._launch_decode(reqs)
        B = len(reqs)
        if self.shapes[shape] is None:  # AR's step: its tokens alone
            res = [[0, 0, 0, tok] for tok in self.next[:B].tolist()]  # the one host read per step
        else:
            res = self.out[:B].tolist()  # the one host read per round
        took = time.perf_counter() - t0 if t0 is not None else None
        self.policy.observe(reqs, shape, Bb, [row[0] + 1 for row in res], took)
        size_of = self.shapes[shape].total_tokens if self.shapes[shape] else 1
        out = []
        for r, (k, size, covered, *emitted) in zip(reqs, res):
            s = r.stats
            self.count_step(s, size_of)
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

    def _launch_decode(self, reqs: list) -> tuple[int, int, float | None]:
        """`decode`'s step launched, nothing read: its shape, its rows bucket, and when it started where its time
        is a step's cost (None: a graph's first use)."""
        B = len(reqs)
        Bb = batch_bucket(B, self.max_batch)
        shape = self._choose(reqs, Bb) if self.planned is None else self.planned
        self.planned = None
        plain = self.shapes[shape] is None
        # the batched draft head multiplies slots 0 .. top-1 in place (vocab/batched.py): top covers every slot
        top = 1 if plain else batch_bucket(max(r.slot for r in reqs) + 1, self.max_batch)
        lags = [self.lags[r.slot] for r in reqs]
        # the catch-up's rows: a round's, its requests' pending ones; a plain step's, none unless a buffer is full
        L = max(lags) if not plain or max(lags) == self.lag_max else 0
        Lb = 0 if L == 0 else self.lag_max
        t0 = time.perf_counter()
        S, mode = self.prepare(reqs, Bb, [lags])
        key = (shape, Bb, top, S, mode, Lb)
        timed = self.replays(key)  # a first use's time is no step's cost: the policy would shun the shape for it
        self.launch(key, lambda: self._round(shape, Bb, top, S, mode, Lb))
        for r in reqs:
            self.lags[r.slot] = (1 if Lb else self.lags[r.slot] + 1) if plain and self.speculates[r.slot] else 0
        return shape, Bb, t0 if timed else None

    def overlappable(self, chunks: list[tuple], decodes: list) -> bool:
        """A plain decode-only step is AR's step: its lengths are known before its tokens, so it may be launched
        before the step in flight is read and read after the next one is launched (Scheduler overlap). A round's
        lengths are its accepted tokens, and a pass with prompt chunks starts windows from host reads: those run
        synchronously, after the step in flight is read."""
        if self._as_ar(chunks, decodes):  # AR's step, prompt chunks and all
            return True
        return not chunks and bool(decodes) and self.planned is not None and self.shapes[self.planned] is None

    def step_async(self, chunks: list[tuple], decodes: list) -> tuple[list[tuple], torch.Tensor, object]:
        """An overlappable step (a plain one) launched, as BatchRunner's: the requests are left as they are, the
        scheduler advances them and reads the tokens later. Its time is no step's cost (the host does not wait
        for it): the policy sees only its plain step (PROBE). A step of requests that all decode as AR's is AR's."""
        if self._as_ar(chunks, decodes):
            self.planned = None
            self.whys.append(("cost", 0, False))
            return BatchRunner.step_async(self, chunks, decodes)
        shape, Bb, t0 = self._launch_decode(decodes)
        self.policy.observe(decodes, shape, Bb, [1] * len(decodes), None)  # its time comes with its tokens
        self.whys.append((self.policy.why, Bb, t0 is not None))  # counted when its tokens are read (`read`)
        return self.launched([(r, False) for r in decodes], self.next[:len(decodes)])

    def count_step(self, stats, size: int, why: str | None = None) -> None:
        """A decoding step of `size` tree tokens in a request's statistics; a plain one (1) with the policy's why
        (`why`: an overlapped step's, chosen before the steps since)."""
        stats.tree_sizes[size] = stats.tree_sizes.get(size, 0) + 1
        if size == 1:
            why = why or self.policy.why
            stats.plain_reasons[why] = stats.plain_reasons.get(why, 0) + 1

    def read(self, reqs: list, seconds: float | None) -> None:
        """The oldest overlapped step's tokens were emitted to `reqs` (its rows of requests that finished at the
        step before are dropped: those ran no step of theirs): each request's plain step counted, and its time
        (`seconds`) the plain shape's cost at its rows bucket. Without it a plain step's cost would stay as
        calibrated wherever plain steps overlap (every decode-only one), and that reads low: at one request on the
        H200 1.56 ms for a step that ran at 1.95, so speculation was priced 1.25x dearer than it was."""
        why, Bb, timed = self.whys.popleft()
        if timed and seconds is not None:
            self.policy.timed(0, Bb, seconds)
        for r in reqs:
            self.count_step(r.stats, 1, why)

    def measure(self, shape: int, Bb: int) -> float:
        """Seconds of one step of `shape` over Bb padding rows (the policy's cost calibration): the same launch,
        bucket and host read as a real step, on CUDA through its captured graph (captured here, so the first real
        step of the bucket replays it). Padding rows write only the pool's block 0 and change no window."""
        self.inp[:, :Bb].copy_(torch.tensor([0, 0, self.pad, 0], device=self.device)[:, None].expand(4, Bb))
        S = bucket_for(self.reserve, self.target.cfg.max_seq_len) if self.graphs else self.reserve
        mode = self.sampler.mode([self.pad])
        plain = self.shapes[shape] is None
        top = 1 if plain else Bb
        key = (shape, Bb, top, S, mode, 0)  # (a round with no pending rows: a catch-up costs the policy nothing yet)
        times = []
        for i in range(5 if self.graphs else 3):  # CUDA: eager, capture, then 3 timed replays; CPU: 1 warm-up
            t0 = time.perf_counter()
            self.launch(key, lambda: self._round(shape, Bb, top, S, mode, 0))
            (self.next if plain else self.out)[:1].tolist()
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
        self.calibrated = True

    def catch_up(self, reqs: list) -> None:
        """Eagerly, the draft over the pending rows of `reqs` (a mixed step's decodes, one of whose lag buffers is
        full): their draft KV and h_last as after per-step catch-up rows; their lags back to 0."""
        B = len(reqs)
        S, _ = self.prepare(reqs, B, [[self.lags[r.slot] for r in reqs]])
        L = max(self.lags[r.slot] for r in reqs)
        slots = self.inp[2, :B]
        self.h_last[slots] = self._catch_up(B, min(batch_bucket(L, self.lag_max), self.lag_max), S,
                                            self.table.index_select(0, slots))
        for r in reqs:
            self.lags[r.slot] = 0

    def _catch_up(self, Bb: int, Lb: int, S: int, table: torch.Tensor) -> torch.Tensor:
        """One causal draft pass over every row's pending rows (inp[3] of them, padded to Lb): row i of a request
        with lag L and committed length n is the plain step at position n - L + i, its token and the target's
        feature there from the lag buffer. Returns each row's h_last (its last pending row's draft hidden; a row
        with none pending keeps its own). Padding rows past a row's lag write draft KV at slots n .. n + Lb - L - 1,
        which the round's draft overwrites before it reads them."""
        n, slots, lag = self.inp[1, :Bb], self.inp[2, :Bb], self.inp[3, :Bb]
        start = n - lag
        pos = (start[:, None] + self.steps_lag[:Lb]).flatten()
        tok = self.lag_tok.index_select(0, slots)[:, :Lb].flatten()
        feat = self.lag_feat.index_select(0, slots)[:, :Lb].flatten(0, 1)
        h = self.draft.hidden(tok, feat, pos, pos, Span(start, causal_mask(Lb, self.device).expand(Bb, Lb, Lb), S,
                                                        table), cache=self.dcache).view(Bb, Lb, -1)
        if self.vocab.takes_ids:  # the pending rows' verified ids, oldest first, to the window's deferred ones
            pending = (self.steps_lag[None, :Lb] < lag[:, None]) & (slots != self.pad)[:, None]
            ver = self.lag_ver.index_select(0, slots)[:, :Lb]
            self.vocab.defer(slots, torch.where(pending[:, :, None], ver, -1).flatten(1))
        last = h.gather(1, (lag - 1).clamp(min=0)[:, None, None].expand(Bb, 1, h.shape[-1]))[:, 0]
        return torch.where((lag > 0)[:, None], last, self.h_last.index_select(0, slots))

    def _plain(self, Bb: int, S: int, mode: str, Lb: int) -> None:
        """A plain step: AR's step (its tokens into self.next), the draft skipped; each row's target feature, token
        and verified top-K_ver ids (for its next round's window update) into its lag buffer at index lag (0 after
        a catch-up of full buffers, Lb > 0)."""
        slots, lag = self.inp[2, :Bb], self.inp[3, :Bb]
        if Lb:
            table = self.table.index_select(0, slots)
            self.h_last[slots] = self._catch_up(Bb, Lb, S, table)
            lag = self.steps[:1].expand(Bb)  # zero
        h, logits = self._decode(Bb, S, mode)
        self._keep((slots, lag), self.draft.features(h), self.next[:Bb], logits)

    def _keep(self, at: tuple, feat: torch.Tensor, tok: torch.Tensor, logits: torch.Tensor,
              ver: torch.Tensor | None = None) -> None:
        """Plain steps' rows into their lag buffers at `at` (batch slots, lag indices): each one's target feature,
        emitted token and verified top-K_ver ids (`ver`, else from its logits)."""
        self.lag_feat.index_put_(at, feat)
        self.lag_tok.index_put_(at, tok)
        if self.vocab.takes_ids:  # (under --tp: the top-K over the ranks' vocabulary slices)
            self.lag_ver.index_put_(at, self.target.topk(logits, self.k_ver) if ver is None else ver)

    def _round(self, shape: int, Bb: int, top: int, S: int, mode: str, Lb: int) -> None:
        if self.shapes[shape] is None:
            return self._plain(Bb, S, mode, Lb)
        t, d, vocab, cfg, dev = self.target, self.draft, self.vocab, self.shapes[shape], self.device
        root, n, slots = self.inp[0, :Bb], self.inp[1, :Bb], self.inp[2, :Bb]
        table = self.table.index_select(0, slots)
        P = cfg.max_path
        temperature = self.sampler.draft_temperature(slots, mode)  # [Bb, 1]
        temperature = None if temperature is None else temperature[:, None]  # over a row's [T, d] hidden

        head = vocab.head_for(slots, top)  # each request through its own vocabulary, the batch in one GEMM

        def heads(h, k):
            return head(tempered(d.head_in(h), temperature), k)

        h_last = self._catch_up(Bb, Lb, S, table) if Lb else self.h_last[slots]
        tree = draft_trees(d, self.dcache, heads, h_last, root, n, table, S, cfg)
        steps = self.steps[:P]
        hid, logits = verify(t, self.cache, tree, n, table, S)
        N, V = tree.tokens.shape[1], logits.shape[-1]
        # greedy rows: the argmax of every node; sampling rows: one draw per node with the uniform of its position
        # (a greedy step keys no uniform: its rows and positions are not made)
        rows = pos = None
        if mode != "greedy":
            rows, pos = slots[:, None].expand(Bb, N).flatten(), (n[:, None] + 1 + tree.depth).flatten()
        choice = self.sampler.choose(logits.view(Bb * N, V), rows, pos, mode)
        path, k, emitted = accept(tree, choice.view(Bb, N), P)
        valid = steps[None, :] <= k[:, None]
        size = vocab.size(slots)
        covered = (vocab.contains(slots, emitted) & valid).sum(1)
        # the accepted path's KV to the committed slots: the physical slots of n + path and n + steps at once
        moved = physical(table, n[:, None] + torch.cat([path, steps.expand(Bb, P)], 1))
        self.cache.move(moved[:, :P], moved[:, P:])  # [Bb, P] each: an index of any shape
        if vocab.takes_ids:
            # the target's top-K_ver ids for the window (none for a shared vocabulary, nor ctx-only's frozen
            # window); a padding row adds nothing to the padding slot's window
            real = (slots != self.pad)[:, None]
            if self.k_tree:  # one top-K over every node's logits, the accepted path's rows among them
                kt = max(self.k_ver, self.k_tree)
                top = t.topk(logits.flatten(0, 1), kt).view(Bb, N, kt)
                ver = top.gather(1, path[:, :, None].expand(Bb, P, kt))[:, :, :self.k_ver]
            else:
                ver = t.topk(logits.gather(1, path[:, :, None].expand(Bb, P, V)).flatten(0, 1), self.k_ver)
            ver = torch.where((valid & real)[:, :, None], ver.reshape(Bb, P, -1), -1).flatten(1)
            if self.k_tree:
                # issue 37: the misses left are content words first seen in the answer, the bonus token of a
                # round. The target's logits at the tree's rejected nodes are already here: a rejected node is
                # the accepted prefix with another guess at some depth, so its top ids are the target's next
                # tokens after a near-identical prefix, mostly those after the bonus token, which the next round
                # drafts (a look-ahead the accepted path cannot give). After ver: the stream's newest, kept first
                ver = torch.cat([ver, torch.where(real, top[:, :, :self.k_tree].flatten(1), -1)], 1)
            # the gathers run on the copy stream, behind the draft forward
            vocab.update(slots, torch.where(real, tree.tokens[:, 1:], -1), ver)
        feat = d.features(hid)  # [Bb, N, d] the target's hidden (EAGLE-2) or [Bb, N, 3 d] its layers (EAGLE-3)
        pos = (n[:, None] + steps).flatten()
        hid_path = feat.gather(1, path[:, :, None].expand(Bb, P, feat.shape[-1])).flatten(0, 1)
        h = d.hidden(emitted.flatten(), hid_path, pos, pos, Span(n, causal_mask(P, dev).expand(Bb, P, P), S, table),
                     cache=self.dcache).view(Bb, P, -1)
        self.h_last[slots] = h.gather(1, k[:, None, None].expand(Bb, 1, h.shape[-1]))[:, 0]
        vocab.join()
        self.out[:Bb, :3 + P].copy_(torch.cat([k[:, None], size[:, None], covered[:, None], emitted], 1))
