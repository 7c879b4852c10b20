"""The batched MicroSpec window (vocab/batched.py) against B independent single-request windows (WindowVocab, the
reference): after every round the same active ids in the same packed slots, the same packed rows, the same state,
and the same draft-head outputs, over random streams whose windows (W_max 16) wrap many times."""
from __future__ import annotations

import torch

from plugins.check import exact_inputs, stream_ids
from trtllm_microspec.vocab.batched import BatchWindow
from trtllm_microspec.vocab.strategies import WindowVocab

V, W, D, K, PINNED, SLOTS = 300, 16, 8, 4, [7, 0], 4


def assert_same(bw: BatchWindow, slot: int, ref: WindowVocab) -> None:
    R = bw.R
    assert torch.equal(bw.ring[slot], ref.ring) and bw.head_pos[slot].item() == ref.head_pos.item()
    assert torch.equal(bw.count[slot], ref.count) and torch.equal(bw.slot_of[slot], ref.slot_of)
    assert torch.equal(bw.id_of[slot, :R], ref.id_of)
    active = ref.id_of >= 0
    assert torch.equal(bw.packed[slot, :R][active], ref.packed[active])
    assert torch.equal(bw.packed[slot, :R][active], ref.head_w[ref.id_of[active]])
    assert bool((bw.first[slot] == ref.first).all())  # both scratches clean


def test_batch_window_equals_independent_windows():
    g = torch.Generator().manual_seed(0)
    head = exact_inputs(g, V, D, dtype=torch.float32)  # exact GEMMs: bmm and linear give the same logits
    bw = BatchWindow(head, W, PINNED, SLOTS)
    refs = {}
    for rnd in range(12):
        if rnd in (0, 5):  # requests join (slot 2 twice: its window restarts from nothing of the last request)
            for slot in ((3, 1, 2) if rnd == 0 else (2,)):
                refs[slot] = WindowVocab("microspec", head, W, PINNED)
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
