"""`microspec train-draft` on the CPU: a few steps on a handful of real ShareGPT conversations with the real
SmolLM2 engine lower the held-out loss, the unrolled (training-time test) steps see exactly what a draft-tree
node sees at inference, the head loads and generates (with its answers' token ranking beside it, MicroSpec's fill), --time-limit fits the schedule to the clock, an
interrupted run resumed from its checkpoint ends with the same weights as an uninterrupted one, --time-limit plans
the data from measured rates, and --eval prints acceptance lengths."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trtllm_microspec import LLM
from trtllm_microspec.cli import main
from trtllm_microspec.data import sharegpt_conversations
from trtllm_microspec.engine.loader import load_target, read_config
from trtllm_microspec.models.model import KVCache, Span
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.models.tokenizer import Tokenizer
from trtllm_microspec.speculative.eagle import load_draft
from trtllm_microspec.speculative.tree import causal
from trtllm_microspec.train import train_draft
from trtllm_microspec.train.train_draft import (CHECKPOINT, EVAL_DEPTHS, pack, plan_rows, target_features, tokenize,
                                                train, unroll)
from trtllm_microspec.vocab.frequency import FREQ_FILE

ROW = 160  # tokens per packed row: two or three of the short conversations below share one
KW = dict(max_len=ROW, steps=4, lr=1e-3, batch_tokens=2 * ROW, ttt_steps=2, seed=3, device="cpu", save_every=2,
          heldout=0.25)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def convs():
    """Real ShareGPT conversations cut to their first exchange, 100 characters a message, so rows hold several."""
    return [[{**m, "content": m["content"][:100]} for m in c[:2]] for c in sharegpt_conversations(8)]


@pytest.fixture(scope="module")
def trained(engine_dir, convs, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    return out, train(engine_dir, out, data=convs, **KW)


def test_sharegpt_conversations():
    convs = sharegpt_conversations(6)
    assert len(convs) == 6
    for c in convs:
        assert c[0]["role"] == "user" and all(m["role"] == ("user", "assistant")[i % 2] for i, m in enumerate(c))
    assert sharegpt_conversations(3) == convs[:3]  # deterministic order


def test_pack_rows():
    seqs = [(np.arange(3), np.array([0, 1, 1], bool)), (np.arange(4), np.array([0, 0, 1, 1], bool)),
            (np.arange(5), np.ones(5, bool))]
    a, b = pack(seqs, 8, CPU)  # 3 + 4 fit a row of 8; the third starts the next; both padded to 8
    assert a.tokens.tolist() == [0, 1, 2, 0, 1, 2, 3, 0] and a.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert a.doc.tolist() == [0, 0, 0, 1, 1, 1, 1, 2] and b.doc.tolist() == [0] * 5 + [1] * 3  # padding: its own
    assert torch.equal(a.mask[4], torch.tensor([False] * 3 + [True, True] + [False] * 3))  # only its own past
    assert a.valid(0).tolist() == [True, True, False, False, True, True, False, False]  # input i+1: own, assistant
    assert a.valid(1).tolist() == [True, False, False, True, True, False, False, False]
    assert not b.valid(0)[4:].any()  # no loss reads into the padding
    assert a.n == 4 and b.n == 4 and (a.real, b.real) == (7, 5)
    # the loss positions are counted on the host, the row then goes to its device (meta: nothing can be read back)
    on = pack(seqs, 8, torch.device("meta"))
    assert [p.n for p in on] == [4, 4] and all(p.tokens.is_meta and p.assistant.is_meta for p in on)


def test_feature_store_holds_the_rows_features(engine_dir, convs):
    """Features cached into one FeatureStore equal those cached row by row, and are views of its buffers (one
    allocation); rows past its size keep their own tensors. EAGLE-3's tapped layers go the same way."""
    target, tok = load_target(engine_dir, CPU, torch.float32, max_seq_len=ROW)
    target.taps = (1, 2, 3)
    rows = pack(tokenize(tok, convs[:6], ROW, "test"), ROW, CPU)[:3]
    alone = pack(tokenize(tok, convs[:6], ROW, "test"), ROW, CPU)[:3]
    store = train_draft.FeatureStore(2)
    assert len(target_features(target, rows, "test", store=store)) == 3
    target_features(target, alone, "test")
    for i, (p, q) in enumerate(zip(rows, alone)):
        assert torch.equal(p.feats, q.feats) and torch.equal(p.aux, q.aux) and p.aux.shape[-1] == 3 * p.feats.shape[-1]
        inside = i < 2
        assert (p.feats.untyped_storage().data_ptr() == store.bufs[0].untyped_storage().data_ptr()) == inside
        assert (p.aux.untyped_storage().data_ptr() == store.bufs[1].untyped_storage().data_ptr()) == inside
    assert store.used == 2 and store.bufs[0].shape == (2, *rows[0].feats.shape)


def test_host_store_packs_its_rows_into_few_allocations(engine_dir, convs, monkeypatch):
    """In host memory a row's tensors and the next rows' share one allocation of up to HOST_CHUNK_BYTES (torch's
    pinned allocator rounds each allocation up to a power of two): rows 0, 1 in one, row 2 in the next, each
    row's features equal to those cached alone."""
    target, tok = load_target(engine_dir, CPU, torch.float32, max_seq_len=ROW)
    target.taps = (1, 2, 3)
    rows = pack(tokenize(tok, convs[:6], ROW, "test"), ROW, CPU)[:3]
    alone = pack(tokenize(tok, convs[:6], ROW, "test"), ROW, CPU)[:3]
    row = ROW * read_config(engine_dir).hidden_size * 4 * 4  # fp32 feats + 3 tapped layers
    monkeypatch.setattr(train_draft, "HOST_CHUNK_BYTES", 2 * row + 1)
    target_features(target, rows, "test", store=train_draft.FeatureStore(3, host=True))
    target_features(target, alone, "test")
    ptr = [(p.feats.untyped_storage().data_ptr(), p.aux.untyped_storage().data_ptr()) for p in rows]
    assert ptr[0][0] == ptr[0][1] == ptr[1][0] == ptr[1][1] != ptr[2][0] == ptr[2][1]
    assert rows[0].feats.untyped_storage().nbytes() == 2 * row
    for p, q in zip(rows, alone):
        assert torch.equal(p.feats, q.feats) and torch.equal(p.aux, q.aux)


def _store_probe(engine_dir, monkeypatch, rows_free: float, rows_host: float = 0):
    """train()'s CUDA sizing on the CPU: `rows_free` rows' features of device memory free beside the training
    step's reserve, `rows_host` rows' of host memory; returns each FeatureStore's [rows, used] (a host store's
    [rows, used, "host"]) and weak references to every cached feature tensor."""
    import weakref

    row = ROW * read_config(engine_dir).hidden_size * 4  # fp32
    monkeypatch.setattr(train_draft, "_feature_memory", lambda dev: int(rows_free * row))
    monkeypatch.setattr(train_draft, "_host_memory", lambda: int(rows_host * row))
    stores, refs = [], []  # each store's [rows, used] (not the store: it must be free to go)

    class Store(train_draft.FeatureStore):
        def __init__(self, rows, host=False, then=None):
            super().__init__(rows, host, then)
            self.seen = [rows, 0] + (["host"] if host else [])
            stores.append(self.seen)

        def keep(self, *ts):
            out = super().keep(*ts)
            self.seen[1] = self.used
            refs.extend(weakref.ref(b) for b in self.bufs or [])
            return out

    real = train_draft.target_features

    def cache(target, packs, desc, until=float("inf"), store=None):
        done = real(target, packs, desc, until, store)
        refs.extend(weakref.ref(p.feats) for p in done)
        return done

    monkeypatch.setattr(train_draft, "FeatureStore", Store)
    monkeypatch.setattr(train_draft, "target_features", cache)
    return stores, refs


def test_feature_store_takes_the_planned_rows_then_gives_them_back(engine_dir, tmp_path, monkeypatch):
    """Under --time-limit the FeatureStore holds the planned rows the probe has not cached (not every row the
    device's memory would hold), and before --eval's engines load nothing holds the cached features any more."""
    import gc

    convs = [[{**m, "content": m["content"][:100]} for m in c[:2]] for c in sharegpt_conversations(24)]
    stores, refs = _store_probe(engine_dir, monkeypatch, rows_free=1000)
    monkeypatch.setattr(train_draft, "perf_counter", lambda: 0.0)  # no time passes: the plan is the rates'
    monkeypatch.setattr(train_draft, "train_rate", lambda *a: 200.0)
    monkeypatch.setattr(train_draft, "_cache_timed", lambda target, packs, desc: (
        train_draft.target_features(target, packs, desc), 100.0)[1])
    monkeypatch.setattr(train_draft, "PROBE_ROWS", 1)  # 2 probe rows
    alive = []

    def spec_eval(*a, **kw):
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
        return {"eagle": 1.0}, {"eagle": {"qa": 1.0}}

    monkeypatch.setattr(train_draft, "spec_eval", spec_eval)
    rows = train_draft._shuffled(pack(tokenize(Tokenizer(engine_dir), convs[:-6], ROW, "rows"), ROW, CPU),
                                 KW["seed"] + 1)
    limit = 0.02 * sum(p.real for p in rows[:5]) + 1e-3  # t / 100 + 2 t / 200 s: the first 5 rows
    want = plan_rows([p.real for p in rows], limit, 100.0, 200.0, 2.0)
    assert want == 5 < len(rows)
    r = train(engine_dir, tmp_path, data=convs, **{**KW, "steps": 1, "epochs": 2.0, "save_every": 0},
              time_limit=limit, eval_tokens=1)
    assert r["rows"] == want and r["acceptance"] == {"eagle": 1.0}
    assert stores == [[want - 2, want - 2]]  # the planned rows less the probe's (no host store: none needed)
    assert len(refs) > want and alive == [0]  # every feature tensor, the store's buffer included, was freed


def test_feature_store_fits_the_device(engine_dir, convs, tmp_path, monkeypatch, capsys):
    """A plan larger than the device's memory: the rows that fit, said in one line; a resumed run whose rows do
    not fit, or a device that holds no row, is a one-line error (not an out-of-memory traceback)."""
    stores, _ = _store_probe(engine_dir, monkeypatch, rows_free=2.5)
    kw = {**KW, "steps": 1, "save_every": 1}
    r = train(engine_dir, tmp_path, data=convs, **kw)
    rows = len(pack(tokenize(Tokenizer(engine_dir), convs[:-2], ROW, "rows"), ROW, CPU))
    assert r["rows"] == 2 < rows and f"memory hold the features of 2 of the {rows} planned rows" in \
        capsys.readouterr().err
    assert stores == [[2, 2]]
    monkeypatch.setattr(train_draft, "_feature_memory", lambda dev: ROW)  # not one row
    with pytest.raises(UserError, match=r"^--resume: the features of 2 rows of 160 tokens need .* GiB; 0.0 GiB of "
                                        r"device memory is free beside 16 GiB for the training step, and 0.0 GiB "
                                        r"of host memory: resume on a machine with more free memory$"):
        train(engine_dir, tmp_path, data=convs, resume=True, **kw)
    with pytest.raises(UserError, match=f"^the features of {rows} rows .*: lower --max-len or free the device$"):
        train(engine_dir, tmp_path / "b", data=convs, **kw)


def test_rows_past_the_device_go_to_host_memory(engine_dir, convs, trained, tmp_path, monkeypatch, capsys):
    """Rows the device's memory cannot hold are cached in host memory, in chunks, and trained on as the device's
    are: the same run with every row on the device ends with the same held-out loss and weights."""
    row = ROW * read_config(engine_dir).hidden_size * 4  # fp32 features
    monkeypatch.setattr(train_draft, "HOST_CHUNK_BYTES", row + 1)  # an allocation a row: more than one
    stores, _ = _store_probe(engine_dir, monkeypatch, rows_free=2.5, rows_host=100)
    moved = []
    real_on = train_draft.Pack.on

    def on(p, dev):
        moved.append(p.feats.untyped_storage().data_ptr())
        return real_on(p, dev)

    monkeypatch.setattr(train_draft.Pack, "on", on)
    r = train(engine_dir, tmp_path, data=convs, **KW)
    rows = len(pack(tokenize(Tokenizer(engine_dir), convs[:-2], ROW, "rows"), ROW, CPU))
    assert rows > 3 and r["rows"] == rows == trained[1]["rows"]  # every row, as without the limit
    assert f"the features of {rows - 2} of the {rows} rows go to host memory (the device holds 2)" in \
        capsys.readouterr().err
    assert sorted(stores, key=len) == [[2, 2], [rows - 2, rows - 2, "host"]]  # (the host store is made first)
    assert r["heldout_loss"] == trained[1]["heldout_loss"] and r["heldout_acc"] == trained[1]["heldout_acc"]
    want, got = load_file(trained[0] / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert len(moved) == KW["steps"] * KW["batch_tokens"] // ROW  # each step's rows went through Pack.on


def test_host_rows_come_to_the_device_for_their_step(engine_dir, convs):
    """Pack.on: a row cached in host memory is copied to the step's device (its loss positions shared, not made
    again); a row already there, or with no features, is itself."""
    target, tok = load_target(engine_dir, CPU, torch.float32, max_seq_len=ROW)
    target.taps = (1, 2, 3)
    p = pack(tokenize(tok, convs[:3], ROW, "test"), ROW, CPU)[0]
    assert p.on(torch.device("meta")) is p  # no features yet
    target_features(target, [p], "test", store=train_draft.FeatureStore(0, then=train_draft.FeatureStore(1, True)))
    p.rows(0)
    assert p.on(CPU) is p
    q = p.on(torch.device("meta"))
    assert q.feats.is_meta and q.aux.is_meta and q.aux.shape == p.aux.shape and q.sel is p.sel
    assert q.tokens is p.tokens and not p.feats.is_meta


def test_unrolled_steps_stay_inside_the_rope_tables(engine_dir, convs, tmp_path):
    """An engine of max_seq_len 64 and --ttt-steps 7 (more than the held-out evaluation's 5 depths): rows are cut
    so that a row's last position + 6 unrolled steps is still a position of the draft's rope tables."""
    small = tmp_path / "engine"
    small.mkdir()
    for f in engine_dir.iterdir():
        if f.name != "config.json":
            (small / f.name).symlink_to(f)
    (small / "config.json").write_text(json.dumps({**json.loads((engine_dir / "config.json").read_text()),
                                                   "max_seq_len": 64}))
    r = train(small, tmp_path / "d", data=convs, **{**KW, "max_len": 4096, "steps": 1, "ttt_steps": 7,
                                                     "batch_tokens": 64, "save_every": 0})
    assert r["steps"] == 1 and r["rows"] >= 1


def test_heldout_loss_goes_down(trained):
    _, r = trained
    assert r["steps"] == 4 and r["heldout_positions"] > 0
    assert r["heldout_loss"] < r["heldout_loss_start"] - 0.1
    assert len(r["heldout_acc"]) == EVAL_DEPTHS and all(0.0 <= a <= 1.0 for a in r["heldout_acc"])


def test_unrolled_step_sees_what_a_tree_node_sees(engine_dir, convs, trained):
    """Step 1 of row i (training) == the draft at inference: the committed context of i's own conversation, then
    one expansion step at position i+1 fed (token i+2, the draft's own hidden of i)."""
    out, _ = trained
    target, tok = load_target(engine_dir, CPU, torch.float32, max_seq_len=ROW)
    draft = load_draft(out, target, torch.float32, CPU)
    p = pack(tokenize(tok, convs[:3], ROW, "test"), ROW, CPU)[0]
    assert int(p.doc.max()) >= 1  # the row holds more than one conversation
    target_features(target, [p], "test")
    with torch.no_grad():
        h0, h1 = unroll(draft, p, 2, None)
        a = int((p.doc == 1).nonzero()[0])  # the second conversation's first row
        i = a + 6
        m = i - a + 1
        zero = torch.zeros((), dtype=torch.long)
        cache = KVCache(draft.cfg, 1, torch.float32, CPU)
        h = draft.hidden(p.tokens[a + 1:i + 2], p.feats[a:i + 1], p.positions[a:i + 1], torch.arange(m),
                         Span(zero, causal(m, CPU), m), cache)
        nxt = draft.hidden(p.tokens[i + 2:i + 3], h[-1:], p.positions[i:i + 1] + 1, torch.tensor([m]),
                           Span(zero + m, torch.ones(1, 1, dtype=torch.bool), m + 1), cache)
    torch.testing.assert_close(h, h0[a:i + 1], atol=1e-4, rtol=1e-4)  # blind to the first conversation
    torch.testing.assert_close(nxt[0], h1[i], atol=1e-4, rtol=1e-4)


def test_saved_head_generates(engine_dir, trained):
    out, _ = trained
    assert {k.split(".")[0] for k in load_file(out / "model.safetensors")} == {"fc", "layers"}
    r = LLM(engine_dir, method="eagle", draft=out, max_seq_len=256, spec_policy="fixed").generate(  # every step a round
        "Hello!", max_new_tokens=8, chat=True)
    assert r.num_new_tokens > 0 and r.stats["rounds"] > 0  # speculative rounds ran with the trained head


def test_saved_head_ranks_its_answers(engine_dir, trained, tmp_path):
    """train-draft writes the ranking of its training answers' tokens beside the head; an engine without its own
    (build-freq) ranking fills MicroSpec's free slots by it, not by token id."""
    out, _ = trained
    f = load_file(out / FREQ_FILE)
    ranked, counts = f["ranked_ids"], f["counts"]
    V = read_config(engine_dir).vocab_size
    assert torch.equal(ranked.sort().values, torch.arange(V)) and int(counts.sum()) > 0
    ordered = counts[ranked]
    assert torch.all(ordered[:-1] >= ordered[1:]) and int(ordered[0]) > int(ordered[50])
    engine = tmp_path / "engine"  # the shared engine's files, without a ranking of its own
    engine.mkdir()
    for e in engine_dir.iterdir():
        if e.name != FREQ_FILE:
            (engine / e.name).symlink_to(e)
    ms = LLM(engine, "microspec", draft=out, w_max=64, max_seq_len=256)
    assert torch.equal(ms.vocab.fill_ids, ranked[:64])


def test_time_limit_fits_the_schedule_then_stops(engine_dir, convs, tmp_path, monkeypatch):
    """A fake clock that stands still but for the optimizer steps: 1 s each for the first 3, then 3 s. The setup
    takes no time, so every row is planned and cached; the plan is fitted to the 1 s steps it measured (start,
    3 steps, 5 s left -> 8 steps); the slower steps then meet the hard limit at step 5."""
    clock = {"t": 1.0, "steps": 0}
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(*args, **kw):  # called once per optimizer step
        clock["steps"] += 1
        clock["t"] += 1 if clock["steps"] <= 3 else 3
        return real_clip(*args, **kw)

    monkeypatch.setattr(train_draft, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    monkeypatch.setattr(train_draft, "PROBE_STEPS", 2)
    r = train(engine_dir, tmp_path, data=convs, **{**KW, "steps": 10_000}, time_limit=8)
    rows = len(pack(tokenize(Tokenizer(engine_dir), convs[:-2], ROW, "rows"), ROW, CPU))
    assert (r["steps"], r["planned_steps"], r["rows"]) == (5, 8, rows)
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["step"] == 5  # the stop saved its checkpoint


def test_time_limit_plans_the_data(engine_dir, convs, tmp_path, monkeypatch, capsys):
    """Measured rates that hold only part of the rows for --epochs epochs: training takes that many rows (whole
    conversations, in the seeded order), and every step that fits."""
    monkeypatch.setattr(train_draft, "perf_counter", lambda: 0.0)  # no time passes: the plan is the rates'
    monkeypatch.setattr(train_draft, "train_rate", lambda *a: 200.0)
    timed = []

    def cache_timed(target, packs, desc):  # cache them, at a rate of 100 tokens/s
        timed.append((desc, [p.tokens.tolist() for p in packs]))
        target_features(target, packs, desc)
        return 100.0

    monkeypatch.setattr(train_draft, "_cache_timed", cache_timed)
    rows = pack(tokenize(Tokenizer(engine_dir), convs[:-2], ROW, "rows"), ROW, CPU)
    rows = train_draft._shuffled(rows, KW["seed"] + 1)  # the order train() caches ShareGPT's rows in
    # t tokens cost t / 100 + 2 * t / 200 s with 2 epochs: 4 s hold 200 tokens, one row of the ~160-token rows
    want = plan_rows([p.real for p in rows], 4.0, 100.0, 200.0, 2.0)
    assert 1 <= want < len(rows)
    r = train(engine_dir, tmp_path, data=convs, **{**KW, "steps": None, "epochs": 2.0}, time_limit=4)
    assert r["rows"] == want and r["train_tokens"] == sum(p.real for p in rows[:want])
    assert f"{want} of {len(rows)} rows" in capsys.readouterr().err
    # the rates are timed on the first training rows of the caching order, not on the held-out rows
    assert [d for d, _ in timed] == ["held-out", "probe"]
    assert timed[1][1] == [p.tokens.tolist() for p in rows[:train_draft.PROBE_ROWS + 1]]


def test_time_limit_refits_the_schedule(engine_dir, convs, tmp_path, monkeypatch):
    """Steps of 3 s for the first 3, then 1 s: the first fit (3 s a step) plans 6 steps; the schedule is re-fitted
    to the step time measured so far every 2 steps, so the run takes the steps the faster ones leave room for and
    its cosine ends at the limit (start 1 s, limit 20 s: 13 steps, the 13th ending at 20 s)."""
    clock = {"t": 1.0, "steps": 0}
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(*args, **kw):
        clock["steps"] += 1
        clock["t"] += 3 if clock["steps"] <= 3 else 1
        return real_clip(*args, **kw)

    monkeypatch.setattr(train_draft, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    monkeypatch.setattr(train_draft, "PROBE_STEPS", 2)
    r = train(engine_dir, tmp_path, data=convs, **{**KW, "steps": 10_000, "save_every": 0, "ttt_steps": 1},
              time_limit=20)
    assert (r["steps"], r["planned_steps"]) == (13, 13) and clock["t"] <= 21


def test_time_limit_leaves_room_for_the_last_checkpoint(engine_dir, convs, tmp_path, monkeypatch):
    """Steps of 1 s, checkpoints of 3 s every 4 steps: from the first one on, the schedule keeps the longest save's
    time free, so the checkpoint after the last step ends by the limit (start 1 s, limit 20 s: 10 steps, the last
    save ending at 20 s; without that room the 12th step's save would end at 22 s)."""
    clock = {"t": 1.0}
    real_clip, real_save = torch.nn.utils.clip_grad_norm_, torch.save

    def clip(*args, **kw):
        clock["t"] += 1
        return real_clip(*args, **kw)

    def save(*args, **kw):
        clock["t"] += 3
        return real_save(*args, **kw)

    monkeypatch.setattr(train_draft, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(train_draft, "PROBE_STEPS", 2)
    r = train(engine_dir, tmp_path, data=convs, **{**KW, "steps": 10_000, "save_every": 4, "ttt_steps": 1},
              time_limit=20)
    assert clock["t"] <= 21 and r["steps"] == 10
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["step"] == 10


def test_resume_matches_uninterrupted_run(engine_dir, convs, trained, tmp_path, monkeypatch):
    out, _ = trained
    saves, real_save = [], torch.save

    def save_then_stop(obj, path):  # interrupt the run right after its first checkpoint (step 2)
        real_save(obj, path)
        saves.append(obj["step"])
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train(engine_dir, tmp_path, data=convs, **KW)
    monkeypatch.undo()
    assert saves == [2]
    with pytest.raises(UserError):  # other settings than the checkpoint's
        train(engine_dir, tmp_path, data=convs, resume=True, **{**KW, "seed": 4})
    r = train(engine_dir, tmp_path, data=convs, resume=True, **KW)
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["step"] == 4 == r["steps"]
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_eval_prints_acceptance(engine_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_draft, "EVAL_CATEGORIES", ("qa",))  # one short prompt: the CPU is slow
    main(["train-draft", "--engine", str(engine_dir), "--out", str(tmp_path), "--conversations", "6",
          "--max-len", "64", "--steps", "1", "--batch-tokens", "64", "--ttt-steps", "1", "--device", "cpu",
          "--save-every", "0", "--eval", "--eval-tokens", "8", "--arch", "eagle2"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["steps"] == 1 and len(r["heldout_acc"]) == EVAL_DEPTHS
    # the head and its answers' ranking, no checkpoint
    assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json", "model.safetensors", FREQ_FILE]
    assert set(r["acceptance"]) == {"eagle", "microspec"} and all(v >= 1.0 for v in r["acceptance"].values())
    assert r["acceptance_by_category"] == {m: {"qa": v} for m, v in r["acceptance"].items()}  # one category here


def test_recipe_trains_eagle3_by_default():
    """train-draft's default head is EAGLE-3 (the better recipe on the H200), EAGLE-2 on asking, its ttt default 3."""
    from trtllm_microspec.cli import build_parser

    a = build_parser().parse_args(["train-draft", "--engine", "e", "--out", "o"])
    assert a.arch == "eagle3" and a.ttt_steps is None
    assert build_parser().parse_args(["train-draft", "--engine", "e", "--out", "o", "--arch", "eagle2"]).arch == "eagle2"
