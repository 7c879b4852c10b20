"""The batched MicroSpec window (vocab/batched.py) against B independent single-request windows (WindowVocab, the
reference): after every round the same active ids in the same packed slots, the same packed rows, the same state,
the same fill and the same draft-head outputs, over random streams whose windows (W_max 16) wrap many times. Then
the fill (strategies.Fill) against a plain-Python reference of its rule over random rounds."""
from __future__ import annotations

import pytest
import torch

from plugins.check import exact_inputs, stream_ids
from trtllm_microspec.vocab.batched import BatchWindow
from trtllm_microspec.vocab.strategies import WindowVocab

V, W, D, K, PINNED, SLOTS = 300, 16, 8, 4, [7, 0], 4


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
    assert torch.equal(bw.packed[slot, :R][live], ref.packed_all[:R][live])
    active = ref.id_of >= 0  # the kept fill ids and the window's
    assert torch.equal(ref.packed[active], ref.head_w[ref.id_of[active]])
    assert bool((bw.first[slot] == ref.first).all())  # both scratches clean


@pytest.mark.parametrize("method", ["microspec", "microspec-paper"])
def test_batch_window_equals_independent_windows(method):
    g = torch.Generator().manual_seed(0)
    head = exact_inputs(g, V, D, dtype=torch.float32)  # exact GEMMs: bmm and linear give the same logits
    ranked = ranking(g)
    fill = method == "microspec"
    bw = BatchWindow(head, W, PINNED, SLOTS, ranked[:W + len(PINNED)] if fill else None)
    refs = {}
    for rnd in range(12):
        if rnd in (0, 5):  # requests join (slot 2 twice: its window restarts from nothing of the last request)
            for slot in ((3, 1, 2) if rnd == 0 else (2,)):
                refs[slot] = WindowVocab(method, head, W, PINNED, ranked)
                assert (refs[slot].fill is not None) == fill
                refs[slot].reset()
                prompt, topk = stream_ids(g, V, 5 + 7 * slot, 0.0), stream_ids(g, V, 10, 0.2)
                bw.start(slot, prompt, topk)
                refs[slot].start(prompt, topk, None)
        batch = torch.tensor(list(refs))
        tree = torch.stack([stream_ids(g, V, 9, 0.1) for _ in refs])  # rows of padding-only appear by chance
        ver = torch.stack([stream_ids(g, V, 6 if rnd != 3 else 0, 0.3) for _ in refs])
        if rnd == 7:
            ver[0] = -1
        bw.update(batch, tree, ver)
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
    assert bw.head_pos[2] > W and bw.head_pos[3] > 3 * W  # the rings wrapped
    if fill:  # the windows were not always full, so the fills were used
        assert (bw.fill_id_of[list(refs)] >= 0).any()


def test_windows_never_mix():
    """Two requests on disjoint ids: each window holds only its own ids (and the pinned), whatever the other
    appends; a request that takes over a slot starts from the pinned ids alone."""
    g = torch.Generator().manual_seed(1)
    head = torch.randn(V, D, generator=g)
    bw = BatchWindow(head, W, PINNED, 3)
    batch = torch.tensor([2, 0])
    low, high = torch.arange(10, 150), torch.arange(150, 300)
    bw.start(2, low[:20], low[20:30])
    bw.start(0, high[:3], high[3:5])

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
    bw.start(2, high[:1], high[:0])
    assert set(bw.id_of[2][bw.id_of[2] >= 0].tolist()) == set(PINNED) | {150}


def reference_fill(window: set[int], ranked: list[int], R: int) -> list[int]:
    """The fill's rule in plain Python: the ranked ids not in the window, most frequent first, as many as the
    window leaves free of its R = W_max + pinned slots."""
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
        self.v = BatchWindow(head, w, PINNED, 3, ranked[:w + len(PINNED)] if method == "microspec" else None)

    def start(self, slot, prompt, topk):
        self.v.start(slot, prompt, topk)

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
    the paper's window (stream ids always win a slot, a fill id never displaces one), its fill is the Python
    rule's (so a joining request's fill is its own window's, nothing of the last request's), the union is always
    the W_max + pinned slots (each stream id that enters displaces one fill id), and size, contains and the draft head see exactly that union."""
    g = torch.Generator().manual_seed(2)
    V2, W2 = 60, 24
    R = W2 + len(PINNED)
    head = exact_inputs(g, V2, D, dtype=torch.float32)
    ranked = ranking(g, V2)
    filled, paper = kind("microspec", head, W2, ranked), kind("microspec-paper", head, W2, ranked)
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
    assert min(sizes) < R // 2 and max(sizes) >= W2  # thin windows (mostly fill) and full ones (little fill) met
