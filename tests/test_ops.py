"""The reference ops (plugins/ops.py, the CPU path) against a plain-Python model of the window.

The paper's definition: active set = Unique(Suffix(stream, W_max)) (+ pinned ids); every active id holds exactly
one slot of the packed buffer and no slot is shared; a newly active id takes the lowest free slot, in order of
first appearance; after the gathers, the packed rows are the LM-head rows of their ids.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from plugins import ops
from plugins.check import STATE, alone, new_window


class WindowModel:
    def __init__(self, W: int, R: int, pinned: list[int]):
        self.W, self.R, self.pinned = W, R, list(pinned)
        self.stream: list[int] = []
        self.slot = {p: i for i, p in enumerate(pinned)}

    def active(self) -> set[int]:
        return set(self.stream[-self.W:]) | set(self.pinned)

    def append(self, ids: list[int]) -> list[tuple[int, int]]:
        before = self.active()
        valid = [i for i in ids if i >= 0]
        self.stream += valid
        now = self.active()
        for gone in before - now:
            del self.slot[gone]
        free = sorted(set(range(self.R)) - set(self.slot.values()))
        new = list(dict.fromkeys(i for i in valid[-self.W:] if i not in before))
        assert len(new) <= len(free)  # R >= W + pinned
        self.slot.update(zip(new, free))
        return list(zip(new, free))


def check_state(st: dict, model: WindowModel, V: int) -> None:
    """st: one window's state (new_window's, window 0) against the model."""
    W, R = model.W, model.R
    st = {k: v[0] for k, v in st.items()}
    assert st["head"].item() == len(model.stream)
    ring = [-1] * W
    for j in range(max(0, len(model.stream) - W), len(model.stream)):
        ring[j % W] = model.stream[j]
    assert st["ring"][:W].tolist() == ring
    count = Counter(model.stream[-W:] if model.stream else []) + Counter(model.pinned)
    want = torch.zeros(V, dtype=torch.int32)
    for i, c in count.items():
        want[i] = c
    assert torch.equal(st["count"][:V], want)
    slot_of = torch.full((V,), -1, dtype=torch.long)
    id_of = torch.full((R,), -1, dtype=torch.long)
    for i, s in model.slot.items():
        slot_of[i], id_of[s] = s, i
    assert set(model.slot) == model.active()
    assert torch.equal(st["slot_of"][:V], slot_of)
    assert torch.equal(st["id_of"][:R], id_of)
    assert bool((st["first"] == ops.BIG).all())  # the scratch is clean between calls


def random_ids(g: torch.Generator, V: int, n: int, pad: float = 0.1) -> torch.Tensor:
    """Mostly a few hot ids (many duplicates), some uniform ones, some -1 padding."""
    hot = torch.randint(V, (max(1, V // 20),), generator=g)
    ids = torch.where(torch.rand(n, generator=g) < 0.7, hot[torch.randint(hot.numel(), (n,), generator=g)],
                      torch.randint(V, (n,), generator=g))
    return torch.where(torch.rand(n, generator=g) < pad, -1, ids)


@pytest.mark.parametrize("V,W,pinned,sizes", [
    (40, 8, [], [5, 20, 0, 3, 9, 1, 30]),  # appends longer than the window, an empty one
    (300, 32, [0, 7], [40, 10, 25, 33, 1, 64]),
    (2000, 256, [3], [600, 60, 250, 250, 0, 90, 250, 250, 300]),
])
def test_window_update_matches_model(V, W, pinned, sizes):
    g = torch.Generator().manual_seed(V)
    d = 8
    head_w = torch.randn(V, d, generator=g)
    st = new_window(V, W, pinned)
    R = st["id_of"].shape[1] - 1
    packed = torch.zeros(R + 1, d)
    if pinned:
        ops.gather_rows(head_w, torch.tensor(pinned), packed, torch.arange(len(pinned)))
    model = WindowModel(W, R, pinned)
    for step, n in enumerate(sizes):
        ids = random_ids(g, V, n, pad=1.0 if step == 3 else 0.1)  # step 3: all padding
        rows, slots = ops.window_update_rows(*(st[k] for k in STATE), ids[None], alone())  # one window: one row
        rows, slots = rows[0], slots[0]
        new = model.append(ids.tolist())
        assert rows.numel() == slots.numel() == 2 * n
        real = slots < R
        assert list(zip(rows[real].tolist(), slots[real].tolist())) == new
        assert bool((rows[~real] == 0).all())
        check_state(st, model, V)
        ops.gather_rows(head_w, rows, packed, slots)
        id_of = st["id_of"][0, :R]
        active = id_of >= 0
        assert torch.equal(packed[:R][active], head_w[id_of[active]])


def test_unique_first_keeps_first_occurrences():
    g = torch.Generator().manual_seed(1)
    first = torch.full((1, 51), ops.BIG)
    for n in (0, 1, 7, 200):
        ids = random_ids(g, 50, n, pad=0.2)
        seen, want = set(), []
        for i in ids.tolist():
            want.append(i if i >= 0 and i not in seen else -1)
            seen.add(i)
        assert ops.unique_first_rows(ids[None], first, alone()).tolist() == [want]
        assert bool((first == ops.BIG).all())


def test_packed_head_equals_full_vocabulary_restricted_to_active_ids():
    g = torch.Generator().manual_seed(2)
    V, W, d, k = 500, 64, 32, 6
    head_w = torch.randn(V, d, generator=g)
    st = new_window(V, W, [5])
    R = st["id_of"].shape[1] - 1
    packed = torch.zeros(R + 1, d)
    ops.gather_rows(head_w, torch.tensor([5]), packed, torch.tensor([0]))
    for n in (100, 30, 30):
        rows, slots = ops.window_update_rows(*(st[k] for k in STATE), random_ids(g, V, n)[None], alone())
        ops.gather_rows(head_w, rows[0], packed, slots[0])
    hidden = torch.randn(3, d, generator=g)
    logp, ids = ops.packed_head(hidden, packed[:R], st["id_of"][0, :R], k)

    logits = (hidden.double() @ head_w.double().T).masked_fill(st["slot_of"][0, :V] < 0, float("-inf"))
    want_logp, want_ids = torch.log_softmax(logits, -1).topk(k)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(logp.double(), want_logp, atol=1e-5)


def test_packed_head_with_fewer_active_ids_than_k():
    packed = torch.randn(5, 4)
    id_of = torch.tensor([9, -1, 3, -1, -1])
    logp, ids = ops.packed_head(torch.randn(1, 4), packed, id_of, 4)
    assert sorted(ids[0, :2].tolist()) == [3, 9] and ids[0, 2:].tolist() == [0, 0]
    assert torch.isfinite(logp[0, :2]).all() and torch.isinf(logp[0, 2:]).all()
    assert torch.allclose(logp[0, :2].exp().sum(), torch.tensor(1.0))


def test_rows_ops_match_each_window_alone(monkeypatch):
    """ops.unique_first_rows / ops.window_update_rows over a batch of windows (the batched engine's): every row
    exactly the op on its own window alone, padding rows change nothing (plugins.check's GPU check, on the CPU
    reference)."""
    import plugins.check as check

    monkeypatch.setattr(check, "DEV", "cpu")
    check.check_rows_ops()
