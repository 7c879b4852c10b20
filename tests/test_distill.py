"""`microspec distill` and `train-draft --data` on the CPU with the real SmolLM2 engine and real ShareGPT prompts:
the stored answers are the target's own (LLM.generate of the same prompts, greedy), a later turn's prompt is the
chat template over the target's earlier answers, a second run continues the first, train-draft learns from the
shards, and bad data directories end in one line. Also the token losses: the chunked soft CE equals the plain one
(value and gradient, fp32 and bf16), and the pruned loss is the soft CE of both distributions renormalised over
its ids."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trtllm_microspec import LLM
from trtllm_microspec.cli import main
from trtllm_microspec.data import prompts_file, sharegpt_conversations
from trtllm_microspec.engine.loader import load_target
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.train import train_draft
from trtllm_microspec.engine.scheduler import StepRecord
from trtllm_microspec.train.distill import FILE_SOURCE, MANIFEST, _steps_line, distill, load_distilled, read_shard
from trtllm_microspec.train.train_draft import SoftCE, loss_head, plan_rows, train

TOKENS = 8  # new tokens per answer: the CPU is slow
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def convs():
    """Real ShareGPT conversations, 200 characters a message (conversation 0 has several user turns)."""
    return [[{**m, "content": m["content"][:200]} for m in c[:4]] for c in sharegpt_conversations(12)]


@pytest.fixture(scope="module")
def shards(engine_dir, convs, tmp_path_factory):
    """Two turns of the first 3 conversations, then (a second run) the first 10: appended."""
    out = tmp_path_factory.mktemp("distilled")
    first = distill(engine_dir, out, turns=2, max_tokens=TOKENS, device="cpu", data=convs[:3])
    second = distill(engine_dir, out, turns=2, max_tokens=TOKENS, device="cpu", data=convs[:10])
    return out, first, second


def answers(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """The generated runs of a stored conversation (each answer, its EOS when it had one)."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + [cur] if cur else runs


def test_answers_are_the_targets_own(engine_dir, convs, shards):
    out, first, second = shards
    assert first["run"]["conversations"] == 3 and second["run"]["conversations"] == 7  # 3 done, 7 appended
    seqs, m = load_distilled(out, engine_dir)
    assert sorted(c for c, _, _ in seqs) == list(range(10)) and m["conversations"] == 10
    assert m["settings"]["turns"] == 2 and m["settings"]["sampling"]["temperature"] == 0.0
    llm = LLM(engine_dir, "ar", device="cpu", max_batch=4)
    by = {c: (ids, mask) for c, ids, mask in seqs}
    firsts = [c[0]["content"] for c in convs[:3]]
    want = [r.token_ids for r in llm.generate(firsts, TOKENS, chat=True)]
    for c in range(3):
        ids, mask = by[c]
        prompt = llm.prompt_ids(firsts[c], chat=True)
        assert ids[:len(prompt)].tolist() == prompt and not mask[:len(prompt)].any()
        assert answers(ids, mask)[0][:len(want[c])] == want[c]  # (+ the template's end-of-turn after an EOS)
    # conversation 0's second turn: its prompt is the template over the target's own first answer
    ids, mask = by[0]
    a1 = answers(ids, mask)[0]
    users = [m["content"] for m in convs[0] if m["role"] == "user"]
    assert len(users) >= 2 and len(answers(ids, mask)) == 2
    msgs = [{"role": "user", "content": users[0]},
            {"role": "assistant", "content": llm.tokenizer.decode(a1)},
            {"role": "user", "content": users[1]}]
    prompt2 = llm.prompt_ids(msgs, chat=True)
    assert ids[:len(prompt2)].tolist() == prompt2
    assert answers(ids, mask)[1] == llm.generate([msgs], TOKENS, chat=True)[0].token_ids
    # the second turns took their history's KV from the prefix cache (the first turns', whole blocks of it)
    assert 0 < second["run"]["cached_tokens"] < second["run"]["prompt_tokens"]


def test_resume_skips_what_is_done_and_refuses_other_settings(engine_dir, convs, shards):
    out, _, _ = shards
    again = distill(engine_dir, out, turns=2, max_tokens=TOKENS, device="cpu", data=convs[:10])
    assert again["run"] == {"answers": 0, "answer_tokens": 0, "conversations": 0, "skipped": 0, "prompt_tokens": 0,
                            "cached_tokens": 0}
    with pytest.raises(UserError, match="other settings"):
        distill(engine_dir, out, turns=1, max_tokens=TOKENS, device="cpu", data=convs[:10])


def test_time_limit_keeps_what_finished(engine_dir, convs, tmp_path):
    """A stop after the first step keeps each answer in flight as far as it got (a prefix of the target's own
    answer, at least its first token), leaves the ones with nothing answered to a later run, which finishes them."""
    r = distill(engine_dir, tmp_path, turns=1, max_tokens=TOKENS, device="cpu", data=convs[:4], time_limit=1e-6)
    m = json.loads((tmp_path / MANIFEST).read_text())
    assert r["stopped"] and m["conversations"] == r["conversations"] == r["run"]["cut_short"] >= 1
    llm = LLM(engine_dir, "ar", device="cpu", max_batch=4)
    firsts = [c[0]["content"] for c in convs[:4]]
    want = [res.token_ids for res in llm.generate(firsts, TOKENS, chat=True)]
    seqs, _ = load_distilled(tmp_path, engine_dir)
    for c, ids, mask in seqs:
        (got,) = answers(ids, mask)
        assert 1 <= len(got) < TOKENS and got == want[c][:len(got)]
    rest = distill(engine_dir, tmp_path, turns=1, max_tokens=TOKENS, device="cpu", data=convs[:4])
    assert rest["run"]["conversations"] == 4 - r["conversations"] and rest["conversations"] == 4


def jsonl(path, lines: list) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_prompts_file_formats(tmp_path):
    """Each line's formats (a string; Spec-Bench's turns; OpenAI's messages, system dropped; ShareGPT's
    conversations, a leading answer dropped) give its user turns in order; blank lines are skipped; the sha256 is
    the file's."""
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([json.dumps("Say hi"), "", json.dumps({"turns": ["a", "b"]}),
                            json.dumps({"messages": [{"role": "system", "content": "s"},
                                                     {"role": "user", "content": "u1"},
                                                     {"role": "assistant", "content": "x"},
                                                     {"role": "user", "content": "u2"}]}),
                            json.dumps({"conversations": [{"from": "gpt", "value": "g"},
                                                          {"from": "human", "value": "h1"}]})]) + "\n")
    convs, sha = prompts_file(f)
    assert [[m["content"] for m in c if m["role"] == "user"] for c in convs] == [["Say hi"], ["a", "b"], ["u1", "u2"],
                                                                                 ["h1"]]
    assert sha == hashlib.sha256(f.read_bytes()).hexdigest()
    assert prompts_file(f, 2)[0] == convs[:2]


@pytest.mark.parametrize("text, message", [
    ('"ok"\n{"turns": ["a"\n', "p.jsonl:2: not a JSON line ("),
    ('"ok"\n\n7\n', "p.jsonl:3: not a conversation; each line is a JSON string"),
    ('{"text": "hi"}\n', "p.jsonl:1: not a conversation"),
    ('{"turns": []}\n', "p.jsonl:1: holds no user turn with text"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "p.jsonl:1: holds no user turn with text"),
    ('"  "\n', "p.jsonl:1: holds no user turn with text"),
    ("\n \n", "p.jsonl holds no prompts"),
    (b"\xff\n", "p.jsonl is not UTF-8 text (byte 0)"),
])
def test_bad_prompts_files(tmp_path, text, message):
    f = tmp_path / "p.jsonl"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError) as e:
        prompts_file(f)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="cannot read the prompts file"):
        prompts_file(tmp_path / "missing.jsonl")


def test_distill_from_a_prompts_file(engine_dir, convs, shards, tmp_path):
    """--prompts: the target answers the file's user turns (its own answers, as from ShareGPT's); the manifest names
    the file by its sha256, so a copy elsewhere continues the run and another file is refused; training on it with
    ShareGPT mixed in leaves out of ShareGPT none of its conversations (the held-out indices are the file's, not
    ShareGPT's), where a directory of ShareGPT's prompts leaves out those it holds out."""
    firsts = [c[0]["content"] for c in convs[:3]]
    f = jsonl(tmp_path / "mine.jsonl", [firsts[0], {"turns": [firsts[1]]},
                                        {"messages": [{"role": "user", "content": firsts[2]}]}])
    out = tmp_path / "d"
    r = distill(engine_dir, out, turns=2, max_tokens=TOKENS, device="cpu", prompts=f)
    seqs, m = load_distilled(out, engine_dir)
    assert r["run"]["conversations"] == 3 and sorted(c for c, _, _ in seqs) == [0, 1, 2]
    assert m["prompt_source"] == FILE_SOURCE + hashlib.sha256(open(f, "rb").read()).hexdigest()
    llm = LLM(engine_dir, "ar", device="cpu", max_batch=4)
    want = [res.token_ids for res in llm.generate(firsts, TOKENS, chat=True)]
    for c, ids, mask in seqs:
        assert answers(ids, mask) and answers(ids, mask)[0][:len(want[c])] == want[c]
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(open(f, "rb").read())
    assert distill(engine_dir, out, turns=2, max_tokens=TOKENS, device="cpu", prompts=copy)["run"]["answers"] == 0
    with pytest.raises(UserError, match="other settings"):
        distill(engine_dir, out, turns=2, max_tokens=TOKENS, device="cpu", prompts=jsonl(tmp_path / "o.jsonl", ["x"]))
    tok = llm.tokenizer
    n_sharegpt = len(train_draft.tokenize(tok, convs, 128, "train"))
    seqs, n_first, _, _ = train_draft.training_data(engine_dir, tok, 128, 0.34, None, convs, out, True, None)
    assert (n_first, len(seqs) - n_first) == (2, n_sharegpt)  # 1 of 3 held out; ShareGPT whole
    given, _, _ = shards  # the conversations of `convs`, by their indices: the held-out one leaves ShareGPT too
    seqs, n_first, _, _ = train_draft.training_data(engine_dir, tok, 128, 0.1, None, convs, given, True, None)
    assert (n_first, len(seqs) - n_first) == (9, len(train_draft.tokenize(tok, convs[:9] + convs[10:], 128, "t")))


def test_bad_data_dirs(engine_dir, shards, tmp_path):
    out, _, _ = shards
    with pytest.raises(UserError, match="no distilled data"):
        load_distilled(tmp_path / "missing", engine_dir)
    with pytest.raises(UserError, match="holds no manifest"):
        load_distilled(tmp_path, engine_dir)
    m = json.loads((out / MANIFEST).read_text())
    bad = tmp_path / "other"
    bad.mkdir()
    (bad / MANIFEST).write_text(json.dumps({**m, "target": "sha256:0"}))
    with pytest.raises(UserError, match="another target"):
        load_distilled(bad, engine_dir)
    (bad / MANIFEST).write_text(json.dumps(m))
    (bad / m["shards"][0]["file"]).write_bytes((out / m["shards"][0]["file"]).read_bytes()[:100])  # cut short
    with pytest.raises(UserError, match="damaged"):
        load_distilled(bad, engine_dir)
    (bad / MANIFEST).write_text("{")
    with pytest.raises(UserError, match="damaged"):
        load_distilled(bad, engine_dir)
    assert read_shard(out / m["shards"][0]["file"])  # the original is intact


def test_cli_bad_data_is_one_line(engine_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-draft", "--engine", str(engine_dir), "--out", str(tmp_path / "o"), "--data",
              str(tmp_path / "nothing"), "--device", "cpu", "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("microspec: error: no distilled data") and "\n" not in err


def test_train_on_shards_lowers_the_loss(engine_dir, convs, shards, tmp_path):
    out, _, _ = shards
    kw = dict(max_len=128, steps=4, lr=1e-3, batch_tokens=256, seed=3, device="cpu", save_every=0, heldout=0.2)
    r = train(engine_dir, tmp_path / "a", distilled=out, **kw)
    assert r["data"] == "distilled" and r["heldout_positions"] > 0
    assert r["heldout_loss"] < r["heldout_loss_start"] - 0.1
    # mixed with ShareGPT: the same held-out conversations (the distilled ones), more training rows
    m = train(engine_dir, tmp_path / "b", distilled=out, mix_sharegpt=True, data=convs, loss="pruned",
              loss_vocab=2048, **kw)
    assert m["data"] == "distilled + ShareGPT" and m["rows"] > r["rows"]
    assert m["heldout_positions"] == r["heldout_positions"] and m["heldout_acc_start"] == r["heldout_acc_start"]
    assert m["heldout_loss"] < m["heldout_loss_start"] - 0.1 and 0.5 < m["loss_vocab_coverage"] <= 1.0


def plain_soft_ce(h, w, want):
    return -(F.linear(want, w).float().softmax(-1) * F.linear(h, w).float().log_softmax(-1)).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_soft_ce_equals_the_plain_one(dtype, monkeypatch):
    monkeypatch.setattr(train_draft, "CE_CHUNK", 3 * 500)  # 3 rows a chunk: 7 rows make 3 chunks
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(500, 32, generator=g) * 0.3).to(dtype)
    h0, want = torch.randn(7, 32, generator=g).to(dtype), torch.randn(7, 32, generator=g).to(dtype)
    h = h0.clone().requires_grad_(True)
    loss, correct = SoftCE.apply(h, w, want)
    (2 * loss).backward()
    ref_h = h0.clone().requires_grad_(True)
    ref = plain_soft_ce(ref_h, w, want)
    (2 * ref).backward()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(h.grad.float(), ref_h.grad.float(), **tol)
    assert int(correct) == int((F.linear(h0, w).argmax(-1) == F.linear(want, w).argmax(-1)).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_soft_ce_trains_its_own_head(dtype, monkeypatch):
    """EAGLE-3's token loss: the draft's logits through its own trained head W, the target's through the target's
    rows Wt: the loss and the gradients of h and W equal autograd's through the plain loss."""
    monkeypatch.setattr(train_draft, "CE_CHUNK", 3 * 500)  # 3 rows a chunk: 7 rows make 3 chunks
    g = torch.Generator().manual_seed(2)
    w0, wt = [(torch.randn(500, 32, generator=g) * 0.3).to(dtype) for _ in range(2)]
    h0, want = torch.randn(7, 32, generator=g).to(dtype), torch.randn(7, 32, generator=g).to(dtype)
    h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    loss, correct = SoftCE.apply(h, w, want, wt)
    (2 * loss).backward()
    ref_h, ref_w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    ref = -(F.linear(want, wt).float().softmax(-1) * F.linear(ref_h, ref_w).float().log_softmax(-1)).sum()
    (2 * ref).backward()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(h.grad.float(), ref_h.grad.float(), **tol)
    assert w.grad.dtype == dtype and w.grad.abs().max() > 0
    torch.testing.assert_close(w.grad.float(), ref_w.grad.float(), **tol)
    assert int(correct) == int((F.linear(h0, w0).argmax(-1) == F.linear(want, wt).argmax(-1)).sum())


def test_pruned_loss_is_the_soft_ce_over_its_ids(engine_dir):
    target, _ = load_target(engine_dir, CPU, torch.float32)
    V = target.head_weight.shape[0]
    eos = target.cfg.eos_ids[0]
    seqs = [(np.array([5, 7, 7, 9, 7, eos]), np.array([0, 1, 1, 1, 1, 0], bool)),
            (np.array([9, 11, 11]), np.array([0, 1, 1], bool))]  # assistant ids: 7 x3, 11 x2, 9 x1
    assert loss_head(target, seqs, "full", 3) == (None, 1.0)
    w, share = loss_head(target, seqs, "pruned", 3)  # EOS, then the two most frequent: 7 and 11
    ids = sorted([eos, 7, 11])
    assert torch.equal(w, target.head_weight[ids]) and share == pytest.approx(5 / 6)
    g = torch.Generator().manual_seed(1)
    h, want = torch.randn(4, w.shape[1], generator=g), torch.randn(4, w.shape[1], generator=g)
    full_q = F.linear(h, target.head_weight)[:, ids].log_softmax(-1)  # renormalised over the ids
    full_p = F.linear(want, target.head_weight)[:, ids].softmax(-1)
    torch.testing.assert_close(SoftCE.apply(h, w, want)[0], -(full_p * full_q).sum(), atol=1e-4, rtol=1e-4)
    assert loss_head(target, seqs, "pruned", V)[0] is None  # the whole vocabulary: the full loss


def test_steps_line_splits_the_wall_time():
    rec = [StepRecord(4, [100, 30], 134, 0, 6, 0, step_s=0.5), StepRecord(6, [], 6, 0, 6, 0, step_s=0.1),
           StepRecord(6, [], 6, 0, 6, 0, step_s=0.2), StepRecord(0, [], 0, 0, 0, 0, step_s=0.01)]  # last: idle
    assert _steps_line(rec, 1.0) == ("3 engine steps: 1 with prompt chunks (134 rows p50, 0.5 s), 2 decode-only "
                                     "(6 rows p50, 0.3 s); 0.2 s between steps")


def test_plan_rows():
    rows = [100] * 10
    # 1000 tokens: 1000/100 (cache) + 3 x 1000/300 (train) = 20 s: all rows fit in 20 s, 5 of them in 10 s
    assert plan_rows(rows, 20.0, 100.0, 300.0, 3) == 10
    assert plan_rows(rows, 10.0, 100.0, 300.0, 3) == 5
    assert plan_rows(rows, 0.0, 100.0, 300.0, 3) == 1  # always a row


def test_one_command_distills_then_trains(engine_dir, tmp_path, capsys):
    """train-draft --distill-time: distil into <out>/distilled, then train on it, one JSON record for both."""
    main(["train-draft", "--engine", str(engine_dir), "--out", str(tmp_path), "--distill-time", "600",
          "--conversations", "4", "--distill-turns", "1", "--distill-max-tokens", "4", "--distill-max-prompt", "200",
          "--max-len", "256", "--steps", "1", "--batch-tokens", "256", "--heldout", "0.25", "--device", "cpu",
          "--save-every", "0", "--arch", "eagle2"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["distill"]["run"]["conversations"] + r["distill"]["run"]["skipped"] == 4
    assert r["data"] == "distilled" and r["steps"] == 1 and (tmp_path / "distilled" / MANIFEST).exists()


def test_distill_releases_its_engine(engine_dir, convs, tmp_path, monkeypatch):
    """train-draft caches features where distill's engine was: nothing of it (its KV pool) may stay alive. Only the
    engine distill made is watched: other tests' LLMs may live on in the same process."""
    import gc
    import weakref

    import trtllm_microspec.llm as llm_module

    made = []

    class Watched(llm_module.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(llm_module, "LLM", Watched)  # distill imports it from there when it runs
    distill(engine_dir, tmp_path, turns=1, max_tokens=2, device="cpu", data=convs[:1])
    gc.collect()
    assert len(made) == 1 and made[0]() is None


def test_time_limit_alone_is_the_recipe(engine_dir, tmp_path, capsys):
    """train-draft --time-limit with no --data distills for a third of it, then trains on the answers mixed with
    ShareGPT; --distill-time 0 trains on ShareGPT alone; a negative one is refused in one line."""
    common = ["--engine", str(engine_dir), "--conversations", "4", "--distill-turns", "1", "--distill-max-tokens",
              "4", "--distill-max-prompt", "200", "--max-len", "256", "--steps", "1", "--batch-tokens", "256",
              "--heldout", "0.25", "--device", "cpu", "--save-every", "0", "--time-limit", "900",
              "--arch", "eagle2"]
    main(["train-draft", "--out", str(tmp_path / "a"), *common])
    out, err = capsys.readouterr()
    r = json.loads(out.strip().splitlines()[-1])
    assert "the recipe: distill 300 s" in err and r["data"] == "distilled + ShareGPT" and r["steps"] == 1
    assert r["distill"]["run"]["conversations"] + r["distill"]["run"]["skipped"] == 4
    assert (tmp_path / "a" / "distilled" / MANIFEST).exists()
    main(["train-draft", "--out", str(tmp_path / "b"), *common, "--distill-time", "0"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["data"] == "ShareGPT" and "distill" not in r and not (tmp_path / "b" / "distilled").exists()
    with pytest.raises(SystemExit) as e:
        main(["train-draft", "--out", str(tmp_path / "c"), *common, "--distill-time", "-1"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == "microspec: error: --distill-time must be at " \
        "least 0, got -1.0"


def test_train_draft_asks_for_expandable_segments(engine_dir, tmp_path, monkeypatch, capsys):
    """train-draft asks CUDA's allocator for expandable segments (without them the 600 s and 720 s recipes ran out of
    device memory on the H200) before anything touches the device, unless the user set the allocator's config."""
    import os
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # restored after the test, whatever it was
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    bad = ["train-draft", "--engine", str(engine_dir), "--out", str(tmp_path), "--device", "cpu",
           "--distill-time", "-1"]
    with pytest.raises(SystemExit):  # refused at once, after the setting
        main(bad)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    with pytest.raises(SystemExit):
        main(bad)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    capsys.readouterr()


def _interpreted(code: list[str], timeout: int = 900):
    """Runs `python -m ...` args under Triton's interpreter (set before triton is imported: a subprocess)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, *code], env=env, capture_output=True, text=True, timeout=timeout)


def test_fused_soft_ce_equals_the_plain_one():
    """The Triton kernel of --loss fused against plain torch: loss, input gradient, agreeing rows; fp32 and bf16,
    one block, several, a vocabulary that is no block multiple, several chunks of rows."""
    pytest.importorskip("triton")
    r = _interpreted(["-m", "trtllm_microspec.train.fused_ce", "--device", "cpu"])
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[-1] == "all passed", r.stdout + r.stderr[-2000:]
    assert sum(l.startswith("PASS") for l in lines) == 6 and any("bfloat16" in l for l in lines)


TRAIN_FUSED = """
import json, sys
from plugins.check_layers import fix_interpreter
fix_interpreter()
from trtllm_microspec.data import prompts_file, sharegpt_conversations
from trtllm_microspec.train import fused_ce
from trtllm_microspec.train.train_draft import train
fused_ce.BLOCK = 16384  # 3 kernel steps a row at smollm2's 49,152 ids: the interpreter's cost is per step
convs = [[{**m, "content": m["content"][:100]} for m in c[:2]] for c in sharegpt_conversations(4)]
kw = dict(max_len=160, steps=2, lr=1e-3, batch_tokens=160, seed=3, device="cpu", save_every=0, heldout=0.25)
print(json.dumps({loss: train(sys.argv[1], sys.argv[2] + "/" + loss, data=convs, loss=loss, **kw)
                  for loss in ("full", "fused")}))
"""


def test_loss_fused_trains_as_full(engine_dir, tmp_path):
    """train-draft --loss fused is --loss full's loss: the same seed gives the same held-out loss and accuracy."""
    pytest.importorskip("triton")
    r = _interpreted(["-c", TRAIN_FUSED, str(engine_dir), str(tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    full, fused = runs["full"], runs["fused"]
    assert fused["loss"] == "fused" and abs(fused["heldout_loss"] - fused["heldout_loss_start"]) > 0.1  # it trained
    assert fused["heldout_loss"] == pytest.approx(full["heldout_loss"], rel=1e-4)
    assert fused["heldout_acc"] == full["heldout_acc"]


def test_loss_fused_needs_cuda(engine_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["train-draft", "--engine", str(engine_dir), "--out", str(tmp_path), "--conversations", "4",
              "--device", "cpu", "--steps", "1", "--loss", "fused", "--arch", "eagle2"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("microspec: error: --loss fused runs a Triton kernel")


def test_loss_fused_is_not_for_eagle3(engine_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-draft", "--engine", str(engine_dir), "--out", str(tmp_path), "--conversations", "4",
              "--device", "cpu", "--steps", "1", "--loss", "fused", "--arch", "eagle3"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == ("microspec: error: --loss fused is for EAGLE-2 heads: --arch eagle3 trains "
                                         "its own LM head with --loss pruned or full")
