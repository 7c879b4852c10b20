"""The batched MicroSpec window (vocab/batched.py) against B independent single-request windows (WindowVocab below,
the plain reference, each on ops.window_update_rows with a batch of one window): after every round the same active ids in the same packed slots, the same packed rows, the same state,
the same fill and the same draft-head outputs, over random streams whose windows (W_max 16) wrap many times. Then
the fill (strategies.Fill) against a plain-Python reference of its rule over random rounds."""
from __future__ import annotations

import pytest
import torch

from plugins import ops
from plugins.check import exact_inputs, padded, stream_ids
from trtllm_microspec.vocab.batched import BatchWindow
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.vocab.strategies import Fill, StaticVocab, Window, fill_ranking

V, W, D, K, PINNED, SLOTS = 300, 16, 8, 4, [7, 0], 4


class WindowVocab:
    """One request's MicroSpec window, the plain reference of BatchWindow: the FIFO window over the candidate
    stream by ops.window_update_rows on this one window (state layout in plugins/ops.py), with an optional fill (strategies.Fill). Its packed rows are [fill F | window R | sink]: the fill's rows are gathered
    once, and one packed_head over the first F + R rows scores both, the fill ids not kept masked as -1."""

    FLAGS = Window.FLAGS

    def __init__(self, name: str, head: torch.Tensor, w_max: int, pinned: list[int],
                 ranked_ids: torch.Tensor | None = None):
        V, d = head.shape
        dev = head.device
        use_prompt, use_rounds, packed, fill, self.distinct = self.FLAGS[name]
        self.head_w, self.w_max, self.pinned = head, w_max, torch.tensor(sorted(set(pinned)), device=dev)
        self.use_prompt, self.use_rounds, self.use_packed = use_prompt, use_rounds, packed
        self.R = R = w_max  # every id it holds, the pinned included, within W_max
        # R ranked ids: enough to fill every slot the window leaves free, whichever of them the window holds
        self.fill = Fill(fill_ranking(ranked_ids, V, R), V, dev) if fill else None
        F = self.fill.F if fill else 0
        self.ring = torch.full((w_max - len(self.pinned) + 1,), -1, dtype=torch.long, device=dev)
        self.head_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.count = torch.zeros(V + 1, dtype=torch.int32, device=dev)
        self.slot_of = torch.full((V + 1,), -1, dtype=torch.long, device=dev)
        self.ids_all = torch.full((F + R + 1,), -1, dtype=torch.long, device=dev)
        self.first = torch.full((V + 1,), ops.BIG, dtype=torch.long, device=dev)
        self.alone = torch.zeros(1, dtype=torch.long, device=dev)  # the window ops' batch: this one window
        self.rows_all = torch.zeros(F + R + 1, d, dtype=head.dtype, device=dev)  # last row: sink for padding
        # the window's own state (plugins/ops.py's id_of and its packed rows) is the part after the fill
        self.id_of_all, self.packed_all = self.ids_all[F:], self.rows_all[F:]
        self.fill_id_of = self.ids_all[:F]  # the kept fill ids (-1: not kept)
        if fill and packed:
            self.rows_all[:F] = head[self.fill.ids]
        self.packed, self.id_of = self.rows_all[:F + R], self.ids_all[:F + R]
        # the gather of newly active rows runs on its own stream, hidden behind the draft backbone
        self.copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and packed else None
        self.in_flight: tuple | None = None

    def reset(self) -> None:
        P = len(self.pinned)
        self.ring.fill_(-1)
        self.head_pos.zero_()
        self.count.zero_()
        self.slot_of.fill_(-1)
        self.ids_all.fill_(-1)
        slots = torch.arange(P, device=self.ring.device)
        self.count[self.pinned] = 1
        self.slot_of[self.pinned] = slots
        self.id_of_all[slots] = self.pinned
        if self.use_packed:
            ops.gather_rows(self.head_w, self.pinned, self.packed_all, slots)

    def _append(self, ids: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        rows, slots = ops.window_update_rows(self.ring[None], self.head_pos, self.count[None], self.slot_of[None],
                                             self.id_of_all[None], self.first[None], ids[None], self.alone)
        rows, slots = rows[0], slots[0]
        if not self.use_packed:
            return
        if self.copy_stream is None:
            ops.gather_rows(self.head_w, rows, self.packed_all, slots)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream())  # the window state is ready
        with torch.cuda.stream(self.copy_stream):
            ops.gather_rows(self.head_w, rows, self.packed_all, slots)
        self.in_flight = (rows, slots)  # keep the inputs alive until the copy stream is done with them

    def join(self) -> None:
        """The compute stream waits for the gather: called after the draft forward it overlaps with."""
        if self.in_flight is not None:
            torch.cuda.current_stream().wait_stream(self.copy_stream)
            self.in_flight = None

    def _refill(self) -> None:
        """The fill of the window as it is now (on the compute stream: its rows need no gather)."""
        if self.fill is not None:  # the ranked ids not in the window, most frequent first, as many as fit
            free = self.R - (self.id_of_all[:self.R] >= 0).sum()
            out = self.slot_of[self.fill.ids] < 0
            out &= torch.cumsum(out.long(), -1) <= free
            self.fill_id_of.copy_(torch.where(out, self.fill.ids, -1))

    def _unique(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.unique_first_rows(ids[None], self.first[None], self.alone)[0]

    def start(self, prompt_ids: torch.Tensor, prompt_topk: torch.Tensor, first_topk: torch.Tensor) -> None:
        self.reset()
        if self.use_prompt:
            self._append(torch.cat([prompt_ids, self._unique(prompt_topk)]))
        else:
            self._append(first_topk)
        self._refill()

    def update(self, tree_ids: torch.Tensor, ver_ids: torch.Tensor) -> None:
        if self.use_rounds:
            new = torch.cat([self._unique(tree_ids), self._unique(ver_ids)])
            if self.distinct:  # only the ids the window lacks
                new = torch.where(self.slot_of[new.clamp(min=0)] >= 0, -1, new)
            self._append(new)
            self._refill()

    def head(self, hidden: torch.Tensor, k: int):
        if not self.use_packed:  # naive: an indexed GEMM over scattered rows, every call
            return ops.packed_head(hidden, self.head_w[self.id_of.clamp(min=0)], self.id_of, k)
        return ops.packed_head(hidden, self.packed, self.id_of, k)

    def size(self) -> torch.Tensor:
        return (self.id_of >= 0).sum()  # the window's ids and the kept fill ids

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        inside = self.slot_of[ids] >= 0
        if self.fill is None:
            return inside
        rank = self.fill.rank_of[ids]
        return inside | (self.fill_id_of[rank.clamp(max=self.fill.F - 1)] >= 0) & (rank < self.fill.F)


def ranking(g: torch.Generator, ids: int = V) -> torch.Tensor:
    """A random ranking whose head holds the pinned ids (the fill must skip them: they are in every window)."""
    rest = [i for i in torch.randperm(ids, generator=g).tolist() if i not in PINNED]
    return torch.tensor(rest[:3] + PINNED + rest[3:])


def assert_same(bw: BatchWindow, slot: int, ref: WindowVocab) -> None:
    R = bw.R
    assert torch.equal(bw.ring[slot], ref.ring) and bw.head_pos[slot].item() == ref.head_pos.item()
    assert torch.equal(bw.count[slot], ref.count) and torch.equal(bw.slot_of[slot], ref.slot_of)
    assert torch.equal(bw.id_of[slot, :R], ref.id_of_all[:R])
    assert torch.equal(bw.fill_id_of[slot], ref.fill_id_of)
    live = ref.id_of_all[:R] >= 0
    if bw.use_packed:  # naive keeps no packed rows: its head gathers them at every call
        assert torch.equal(bw.packed[slot, :R][live], ref.packed_all[:R][live])
        active = ref.id_of >= 0  # the kept fill ids and the window's
        assert torch.equal(ref.packed[active], ref.head_w[ref.id_of[active]])
    assert bool((bw.first[slot] == ref.first).all())  # both scratches clean


@pytest.mark.parametrize("method", list(WindowVocab.FLAGS))  # the windows and their ablations
def test_batch_window_equals_independent_windows(method):
    g = torch.Generator().manual_seed(0)
    head = exact_inputs(g, V, D, dtype=torch.float32)  # exact GEMMs: bmm and linear give the same logits
    ranked = ranking(g)
    use_prompt, use_rounds, packed, fill, distinct = WindowVocab.FLAGS[method]
    bw = BatchWindow(head, W, PINNED, SLOTS, ranked[:W] if fill else None, use_prompt, use_rounds,
                     packed, distinct=distinct)
    refs, fill_used = {}, False
    for rnd in range(12):
        if rnd in (0, 5, 11):  # requests join (slot 2 twice: its window restarts from nothing of the last request)
            joins = {0: (3, 1, 2), 5: (2,), 11: (0,)}[rnd]
            prompts, topks, firsts = [], [], []
            for slot in joins:
                refs[slot] = WindowVocab(method, head, W, PINNED, ranked)
                assert (refs[slot].fill is not None) == fill
                refs[slot].reset()
                prompts.append(stream_ids(g, V, 5 + 7 * slot, 0.0))
                topks.append(stream_ids(g, V, 10, 0.2))
                firsts.append(torch.randperm(V, generator=g)[:3])  # the target's top-K_ver after the prompt (ext-only)
                refs[slot].start(prompts[-1], topks[-1], firsts[-1])
            bw.start(torch.tensor(joins), padded(prompts), padded(topks), torch.stack(firsts))  # all in one call
        batch = torch.tensor(list(refs))
        tree = torch.stack([stream_ids(g, V, 9, 0.1) for _ in refs])  # rows of padding-only appear by chance
        ver = torch.stack([stream_ids(g, V, 6 if rnd != 3 else 0, 0.3) for _ in refs])
        if rnd == 7:
            ver[0] = -1
        bw.update(batch, tree, ver)
        fill_used |= bool((bw.fill_id_of[batch] >= 0).any())
        for b, (slot, ref) in enumerate(refs.items()):
            ref.update(tree[b], ver[b])
            assert_same(bw, slot, ref)
        hidden = exact_inputs(g, len(refs), 3, D, dtype=torch.float32)
        logp, ids = bw.head(hidden, batch, SLOTS, K)
        sizes, inside = bw.size(batch), bw.contains(batch, tree.clamp(min=0))
        for b, ref in enumerate(refs.values()):
            want_logp, want_ids = ref.head(hidden[b], K)
            assert torch.equal(logp[b], want_logp) and torch.equal(ids[b], want_ids)
            assert sizes[b] == ref.size() and torch.equal(inside[b], ref.contains(tree[b].clamp(min=0)))
        if 0 in refs:  # a request alone in slot 0 (head slots bucket 1: the head's path without scatter / gather)
            logp, ids = bw.head(hidden[:1], torch.tensor([0]), 1, K)
            want_logp, want_ids = refs[0].head(hidden[0], K)
            assert torch.equal(logp[0], want_logp) and torch.equal(ids[0], want_ids)
    if use_rounds:
        assert bw.head_pos[2] > W and bw.head_pos[3] > 3 * W  # the rings wrapped
    if fill:  # the windows were not always full, so the fills were used
        assert fill_used


def test_windows_never_mix():
    """Two requests on disjoint ids: each window holds only its own ids (and the pinned), whatever the other
    appends; a request that takes over a slot starts from the pinned ids alone."""
    g = torch.Generator().manual_seed(1)
    head = torch.randn(V, D, generator=g)
    bw = BatchWindow(head, W, PINNED, 3)
    batch = torch.tensor([2, 0])
    low, high = torch.arange(10, 150), torch.arange(150, 300)
    bw.start(batch, padded([low[:20], high[:3]]), padded([low[20:30], high[3:5]]))

    def pick(ids):  # two rows of 8 ids from one request's own range
        return ids[torch.randint(ids.numel(), (2, 8), generator=g)]

    for _ in range(6):
        bw.update(batch, torch.stack([pick(low)[0], pick(high)[0]]), torch.stack([pick(low)[1], pick(high)[1]]))
        for slot, own in ((2, low), (0, high)):
            active = set(bw.id_of[slot][bw.id_of[slot] >= 0].tolist())
            assert active - set(PINNED) <= set(own.tolist()) and set(PINNED) <= active
        _, ids = bw.head(torch.randn(2, 5, D, generator=g), batch, 3, K)
        assert set(ids[0].flatten().tolist()) <= set(low.tolist()) | set(PINNED)
        assert set(ids[1].flatten().tolist()) <= set(high.tolist()) | set(PINNED)
        assert bw.size(torch.tensor([1])).item() == 0  # the free slot was never touched
    bw.start(torch.tensor([2]), high[None, :1], high[None, :0])
    assert set(bw.id_of[2][bw.id_of[2] >= 0].tolist()) == set(PINNED) | {150}


STATE = ("ring", "head_pos", "count", "slot_of", "id_of", "first", "fill_id_of", "pending")


@pytest.mark.parametrize("filled", [False, True])
def test_start_many_equals_one_at_a_time(filled):
    """The prompt pass starts every window whose prompt it completes in one call: prompts of 5 to 300 ids, 3 top-K_pre
    ids a prompt row, both -1 padded to the longest, into slots that held other requests (their windows, fill and
    deferred ids must go), W_max 64 (the long prompts' windows overflow, the short ones' do not): every state
    tensor, the packed rows and then a round's update are those of starting each request alone, slots outside
    the call untouched, and each window holds its own request's ids and the pinned, no padding and no other's."""
    g = torch.Generator().manual_seed(4)
    V2, W2, slots, k_pre = 2000, 64, 8, 3
    head = exact_inputs(g, V2, D, dtype=torch.float32)
    fill = ranking(g, V2)[:W2] if filled else None
    many, alone = (BatchWindow(head, W2, PINNED, slots, fill) for _ in range(2))
    old = torch.tensor([0, 2, 3, 5, 6])  # earlier requests: slots 2 and 6 keep theirs, running through the starts
    for bw in (many, alone):
        g_old = torch.Generator().manual_seed(5)
        bw.start(old, stream_ids(g_old, V2, 5 * 40, 0.0).view(5, 40), stream_ids(g_old, V2, 5 * 120, 0.1).view(5, 120))
        bw.defer(old, stream_ids(g_old, V2, 5 * 3, 0.0).view(5, 3))  # deferred ids a restarted slot must drop
    batch = torch.tensor([5, 0, 7, 3, 1])  # not in slot order; 7 and 1 free until now
    lengths = [300, 5, 41, 120, 17]
    prompts = [stream_ids(g, V2, n, 0.0) for n in lengths]
    topks = [stream_ids(g, V2, k_pre * n, 0.0) for n in lengths]
    many.start(batch, padded(prompts), padded(topks))
    for slot, prompt, topk in zip(batch.tolist(), prompts, topks):
        alone.start(torch.tensor([slot]), prompt[None], topk[None])
    R = many.R
    for name in STATE:
        assert torch.equal(getattr(many, name), getattr(alone, name)), name
    assert torch.equal(many.packed[:, :R], alone.packed[:, :R])
    live = many.id_of[:, :R] >= 0
    assert torch.equal(many.packed[:, :R][live], head[many.id_of[:, :R][live]])
    for slot, prompt, topk in zip(batch.tolist(), prompts, topks):
        own = set(prompt.tolist()) | set(topk.tolist()) | set(PINNED)
        active = set(many.id_of[slot, :R][live[slot]].tolist())
        counted = set(many.count[slot, :V2].nonzero().flatten().tolist())
        assert set(PINNED) <= active <= own and counted <= own and set(many.ring[slot].tolist()) <= own | {-1}
        assert many.count[slot, V2] == 0 and many.slot_of[slot, V2] == -1  # padding left no trace in the sentinel
        assert (many.pending[slot] == -1).all()
    assert (many.head_pos[batch] > W2).any() and (many.head_pos[batch] < W2).any()  # overflowed and not
    assert (many.pending[[2, 6]] >= 0).any()  # the running slots kept their deferred ids
    if filled:  # thin windows take the fill, full ones none
        assert (many.fill_id_of[batch] >= 0).sum(1).max() > 0
    running = torch.tensor([0, 1, 2, 3, 5, 6, 7])
    tree, ver = stream_ids(g, V2, 7 * 20, 0.1).view(7, 20), stream_ids(g, V2, 7 * 4, 0.3).view(7, 4)
    for bw in (many, alone):
        bw.update(running, tree, ver)
    for name in STATE:
        assert torch.equal(getattr(many, name), getattr(alone, name)), name
    assert torch.equal(many.packed[:, :R], alone.packed[:, :R])


def reference_fill(window: set[int], ranked: list[int], R: int) -> list[int]:
    """The fill's rule in plain Python: the ranked ids not in the window, most frequent first, as many as the
    window leaves free of its R = W_max slots."""
    return [i for i in ranked if i not in window][:R - len(window)]


class Single:
    """A WindowVocab seen through the accessors the fill test reads (one request at a time)."""

    def __init__(self, method, head, w, ranked):
        self.v = WindowVocab(method, head, w, PINNED, ranked)

    def start(self, slot, prompt, topk):
        self.v.start(prompt, topk, None)

    def update(self, slot, tree, ver):
        self.v.update(tree, ver)

    def window(self, slot):
        ids = self.v.id_of_all[:self.v.R]
        return set(ids[ids >= 0].tolist())

    def fill(self, slot):
        f = self.v.fill_id_of
        return f[f >= 0].tolist()

    def size(self, slot):
        return self.v.size().item()

    def contains(self, slot, ids):
        return self.v.contains(ids)

    def head_ids(self, slot, hidden):
        return self.v.head(hidden, K)[1]


class Batched(Single):
    """A BatchWindow of 3 slots through the same accessors."""

    def __init__(self, method, head, w, ranked):
        self.v = BatchWindow(head, w, PINNED, 3, ranked[:w] if method == "microspec" else None,
                             distinct=Window.FLAGS[method][4])

    def start(self, slot, prompt, topk):
        self.v.start(torch.tensor([slot]), prompt[None], topk[None])  # a batch of one

    def update(self, slot, tree, ver):
        self.v.update(torch.tensor([slot]), tree[None], ver[None])

    def window(self, slot):
        ids = self.v.id_of[slot, :self.v.R]
        return set(ids[ids >= 0].tolist())

    def fill(self, slot):
        f = self.v.fill_id_of[slot]
        return f[f >= 0].tolist()

    def size(self, slot):
        return self.v.size(torch.tensor([slot])).item()

    def contains(self, slot, ids):
        return self.v.contains(torch.tensor([slot]), ids[None])[0]

    def head_ids(self, slot, hidden):
        return self.v.head(hidden[None], torch.tensor([slot]), 3, K)[1][0]


@pytest.mark.parametrize("kind", [Single, Batched])
def test_fill_rule(kind):
    """Random rounds over a small vocabulary (the stream often brings in ranked ids), three requests in turn, the
    batched ones taking over a used slot: after every start and update the filled window's stream part is exactly
    the paper's window with a round's ids already held not appended again (stream ids always win a slot, a fill id
    never displaces one), its fill is the Python
    rule's (so a joining request's fill is its own window's, nothing of the last request's), the union is always
    the W_max slots, pinned ids included (each stream id that enters displaces one fill id), and size, contains and the draft head see exactly that union."""
    g = torch.Generator().manual_seed(2)
    V2, W2 = 60, 24
    R = W2
    head = exact_inputs(g, V2, D, dtype=torch.float32)
    ranked = ranking(g, V2)
    filled, paper = kind("microspec", head, W2, ranked), kind("microspec-paper", head, W2, ranked)
    assert filled.v.distinct and not paper.v.distinct
    paper.v.distinct = True  # ours' stream part: the paper's suffix of distinct ids
    top = ranked[:R].tolist()
    every = torch.arange(V2)
    sizes = set()
    for slot, prompt_len, rounds in ((1, 3, 10), (1, 1, 3), (0, 40, 6)):
        for rnd in range(rounds + 1):
            if rnd == 0:
                prompt, topk = stream_ids(g, V2, prompt_len, 0.0), stream_ids(g, V2, 2 * prompt_len, 0.2)
                filled.start(slot, prompt, topk)
                paper.start(slot, prompt, topk)
            else:
                n = [0, 2, 5, 30][rnd % 4]  # 30: more than the window in one append
                tree, ver = stream_ids(g, V2, n, 0.1), stream_ids(g, V2, 3, 0.3)
                filled.update(slot, tree, ver)
                paper.update(slot, tree, ver)
            window, fill = filled.window(slot), filled.fill(slot)
            assert window == paper.window(slot)
            assert fill == reference_fill(window, top, R)
            union = window | set(fill)
            assert len(union) == len(window) + len(fill) == R  # R ranked ids fill whatever the window leaves
            assert filled.size(slot) == len(union) <= R
            assert set(every[filled.contains(slot, every)].tolist()) == union
            assert set(filled.head_ids(slot, exact_inputs(g, 5, D, dtype=torch.float32)).flatten().tolist()) <= union
            sizes.add(len(window))
    assert min(sizes) < R // 2 and max(sizes) >= W2 - len(PINNED)  # thin windows (mostly fill), full ones (little)


@pytest.mark.parametrize("method", list(WindowVocab.FLAGS))
def test_window_never_exceeds_w_max(method):
    """Adversarial streams: every append brings more distinct ids than the window holds, the pinned ids among them
    and left out by turns, a prompt of more distinct ids than W_max: after every start and update the ids the draft
    may propose (contains over the whole vocabulary), its size and the head's ids stay within W_max."""
    g = torch.Generator().manual_seed(3)
    head = exact_inputs(g, V, D, dtype=torch.float32)
    fill = WindowVocab.FLAGS[method][3]
    bw = BatchWindow(head, W, PINNED, 2, ranking(g)[:W] if fill else None, *WindowVocab.FLAGS[method][:3],
                     distinct=WindowVocab.FLAGS[method][4])
    every = torch.arange(V).expand(2, V)
    batch = torch.tensor([0, 1])
    bw.start(batch, torch.stack([torch.randperm(V, generator=g)[:3 * W] for _ in batch]),
             torch.stack([torch.randperm(V, generator=g)[:2 * W] for _ in batch]),
             torch.stack([torch.randperm(V, generator=g)[:W] for _ in batch]))
    for rnd in range(8):
        tree = torch.randperm(V, generator=g)[:2 * W].expand(2, -1).clone()
        ver = torch.tensor(PINNED * 3 if rnd % 2 else [], dtype=torch.long).expand(2, -1)
        bw.update(batch, tree, ver)
        proposable = bw.contains(batch, every).sum(1)
        assert (proposable <= W).all() and (bw.size(batch) == proposable).all()
        assert bw.contains(batch, torch.tensor(PINNED).expand(2, -1)).all()  # the pinned never leave
        if fill:  # a filled window is always exactly full
            assert (proposable == W).all()
        _, ids = bw.head(exact_inputs(g, 2, 4, D, dtype=torch.float32), batch, 2, K)
        assert all(bool(bw.contains(batch[b:b + 1], ids[b].flatten()[None]).all()) for b in range(2))


def test_window_refuses_w_max_within_the_pinned():
    with pytest.raises(UserError, match="w_max 2 leaves no room beside the 2 pinned"):
        Window("microspec", torch.zeros(V, D), 2, PINNED)


def test_static_vocab_holds_k_ids_with_the_pinned():
    """frspec's K counts the pinned ids too, ranked among the K or not."""
    head = torch.zeros(V, D)
    for ranked in (torch.arange(V - 1, -1, -1), torch.arange(V)):  # the pinned ranked last, then among the first
        v = StaticVocab(head, ranked, 10, PINNED)
        assert v.size().item() == v.id_of.numel() == 10 and set(PINNED) <= set(v.id_of.tolist())
        assert v.contains(torch.arange(V)).sum().item() == 10
