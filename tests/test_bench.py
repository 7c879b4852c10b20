"""`microspec bench`, the CPU smoke version: one question from three categories (MT-bench with its second turn,
translation, HumanEval), a few tokens, every main method plus one point of each sweep, on the real SmolLM2 engine
with a random draft head (losslessness must hold for any draft)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trtllm_microspec.bench.specbench import data_dir, load_questions
from trtllm_microspec.cli import main
from trtllm_microspec.engine.loader import read_config
from trtllm_microspec.engine.scheduler import Request
from trtllm_microspec.engine.stats import load_times, percentiles, request_times
from trtllm_microspec.llm import FREQ_FILE

CATS = ["mt_bench", "translation", "code"]
SPEC = ["eagle", "frspec", "microspec", "microspec-paper", "frspec@K=1024", "microspec@W=512", "microspec-paper@W=512"]


@pytest.fixture(scope="module")
def bench(engine_dir, random_draft_dir, tmp_path_factory):
    # a copy of the shared engine (links) with a synthetic FR-Spec ranking, so the shared one is never touched
    eng = tmp_path_factory.mktemp("engine")
    for f in engine_dir.iterdir():
        if f.name != FREQ_FILE:
            (eng / f.name).symlink_to(f.resolve())
    V = read_config(engine_dir).vocab_size
    save_file({"ranked_ids": torch.randperm(V, generator=torch.Generator().manual_seed(0))}, eng / FREQ_FILE)
    out = tmp_path_factory.mktemp("bench")
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        main(["bench", "--engine", str(eng), "--draft", str(random_draft_dir), "--device", "cpu",
              "--categories", ",".join(CATS), "--limit", "1", "--max-new-tokens", "4", "--warmup", "1",
              "--methods", "ar,eagle,frspec,microspec,microspec-paper,hf", "--frspec-k", "1024", "--w-max-sweep", "512,3072",
              "--depth", "2", "--total-tokens", "8", "--spec-policy", "fixed", "--out", str(out)])
    return json.loads((out / "results.json").read_text()), out, log.getvalue()


def test_progress_names_each_stage(bench):
    _, _, log = bench
    assert "[bench] 3 questions (" in log
    assert "9 runs: ar, eagle, frspec, microspec, microspec-paper, frspec@K=1024, microspec@W=512, " in log
    lines = [line for line in log.splitlines() if line.startswith("[bench] ")]
    for label in ("ar", "eagle", "microspec@W=512"):
        for stage in ("loading the model", "1 warm-up requests", "question 1/3 (", "question 3/3 (", "tok/s"):
            assert any(f" {label}: " in line and stage in line for line in lines), (label, stage)


def test_every_method_and_category(bench):
    res, _, _ = bench
    hf = ["hf"] if importlib.util.find_spec("transformers") else []  # an optional dependency
    assert set(res["runs"]) == {"ar", *SPEC, *hf}  # W=3072 is the main microspec run, not run twice
    for name, run in res["runs"].items():
        assert set(run["summary"]) == {*CATS, "overall"}, name
        assert run["summary"]["mt_bench"]["turns"] == 2 and run["summary"]["overall"]["questions"] == 3
        assert all(s["new_tokens"] > 0 and s["speed"] > 0 for s in run["summary"].values())
    assert all(s["speedup"] == 1.0 for s in res["runs"]["ar"]["summary"].values())


def test_lossless_and_draft_stats(bench):
    res, _, _ = bench
    for name in SPEC:
        run = res["runs"][name]
        assert run["lossless"] and not run["mismatches"], name
        s = run["summary"]["overall"]
        assert s["acceptance_length"] >= 1.0 and s["draft_share"] is None  # a round is one launch: not split
        assert 0 <= s["coverage"] <= 1
    paper = res["runs"]["microspec-paper@W=512"]["summary"]["overall"]
    assert paper["vocab_mean"] <= 512  # the pinned EOS within the window
    # filled: always the whole budget, the fill counted (the window is thinner than 513 ids on these prompts)
    assert res["runs"]["microspec@W=512"]["summary"]["overall"]["vocab_mean"] == 512 > paper["vocab_mean"]
    assert res["runs"]["eagle"]["summary"]["overall"]["coverage"] == 1.0


def test_second_turn_sees_the_first_answer(bench):
    res, _, _ = bench
    t0, t1 = [r for r in res["runs"]["ar"]["turns"] if r["category"] == "mt_bench"]
    assert t1["prompt_tokens"] > t0["prompt_tokens"] + t0["new_tokens"]


def test_static_coverage_and_outputs(bench):
    res, out, _ = bench
    cov = res["static_coverage"]
    assert cov["k"][-1] == read_config(res["config"]["engine"]).vocab_size
    assert cov["overall"] == sorted(cov["overall"]) and cov["overall"][-1] == 1.0
    for png in ("fig6_wmax.png", "fig1b_coverage.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "| microspec@W=512 |" in md and "microspec sweep over w_max" in md
    assert "| microspec-paper@W=512 |" in md and "microspec-paper sweep over w_max" in md


def test_questions():
    qs = load_questions(data_dir(None), ["mt_bench", "code"], 2)
    # MT-bench round-robin over its sub-categories: writing's first, then roleplay's first
    assert [q["qid"] for q in qs] == ["81", "91", "HumanEval/0", "HumanEval/1"]
    assert all(len(q["turns"]) == 2 for q in qs[:2])
    assert qs[2]["turns"][0].startswith("Complete the following Python function:\n```python\nfrom typing import List")


@pytest.mark.parametrize("args", [["--categories", "nope"], ["--methods", "ar,nope"], ["--data", "/nonexistent"],
                                  ["--concurrency", "2", "--methods", "ar,hf"],
                                  ["--methods", "ar,microspec@sometimes"], ["--concurrency", "0"],
                                  ["--concurrency", "2,x"],
                                  ["--concurrency", "2", "--tp", "2"], ["--server", "127.0.0.1:1"],
                                  ["--requests", "5"], ["--concurrency", "2", "--requests", "0"],
                                  ["--concurrency", "2", "--requests", "5", "--requests-per-level", "1"]])
def test_bad_input(args, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "microspec: error:" in err and len(err.strip().splitlines()) == 1


def test_level_questions():
    """A level's first turns: all; --requests-per-level K, K x c of them; --requests N exactly N; both repeated past
    the last (a level of more slots than questions still holds K a slot) and round-robin over the categories."""
    from argparse import Namespace

    from trtllm_microspec.bench.specbench import level_questions
    qs = [{"qid": f"{c}{i}", "category": c} for c in "ab" for i in range(3)]

    def ids(k=None, n=None, c=2):
        return [q["qid"] for q in level_questions(qs, Namespace(requests_per_level=k, requests=n), c)]

    assert ids() == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert ids(k=1) == ["a0", "b0"] and ids(k=2, c=3) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert ids(k=2, c=4) == ["a0", "b0", "a1", "b1", "a2", "b2", "a0", "b0"]
    assert ids(n=3) == ["a0", "b0", "a1"] and ids(n=8) == ["a0", "b0", "a1", "b1", "a2", "b2", "a0", "b0"]


def test_inter_token_latency_on_fixed_times():
    """One value per token after the first: a step that emits k tokens shares its gap among them."""
    r = Request(prompt=[1], max_new_tokens=8, emits=[(1.0, 1), (1.5, 1), (2.5, 2), (2.8, 3)])
    assert r.inter_token_s == pytest.approx([0.5, 0.5, 0.5, 0.1, 0.1, 0.1])


def test_load_times_on_fixed_times():
    """The one timing definition of bench --concurrency (ours and vLLM's): from each request's submission."""
    # 5 requests submitted at 10.0, first tokens 0.1 .. 0.5 s later, each then one step of 2 tokens 0.4 s later
    reqs = [(10.0, [(10.0 + f, 1), (10.4 + f, 2)]) for f in (0.4, 0.1, 0.3, 0.2, 0.5)]
    times, each = load_times(reqs)
    assert times["ttft_s"] == {"p50": pytest.approx(0.3), "p90": pytest.approx(0.46), "p99": pytest.approx(0.496)}
    assert times["latency_s"] == {"p50": pytest.approx(0.7), "p90": pytest.approx(0.86), "p99": pytest.approx(0.896)}
    assert times["itl_s"] == {k: pytest.approx(0.2) for k in ("p50", "p90", "p99")}  # 0.4 s shared by 2 tokens
    assert [e["ttft_s"] for e in each] == pytest.approx([0.4, 0.1, 0.3, 0.2, 0.5])
    assert each[0]["inter_token_s"] == pytest.approx([0.2, 0.2])
    # queued: submitted with the others, its first token only after a slot freed (1.0 s): counted from submission
    r = request_times(5.0, [(6.0, 1), (6.1, 1), (6.3, 1)])
    assert r == {"ttft_s": pytest.approx(1.0), "latency_s": pytest.approx(1.3),
                 "inter_token_s": pytest.approx([0.1, 0.2])}
    assert request_times(5.0, []) == {"ttft_s": None, "latency_s": None, "inter_token_s": []}
    with pytest.raises(ValueError):  # a token before its submission: two clocks mixed
        request_times(5.0, [(4.0, 1)])
    times, _ = load_times([(0.0, [(1.0, 1)]), (0.0, [])])  # one without tokens (no times) is left out
    assert times["ttft_s"]["p50"] == 1.0 and times["latency_s"]["p50"] == 1.0 and times["itl_s"]["p50"] is None


def test_percentiles_on_fixed_numbers():
    assert percentiles([4.0, 1.0, 3.0, 2.0, 5.0]) == {"p50": 3.0, "p90": 4.6, "p99": pytest.approx(4.96)}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_concurrency_table(engine_dir, random_draft_dir, tmp_path):
    """--concurrency 1,2: the first turns of 2 questions through the batched engine, 1 then 2 in flight, per method."""
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        main(["bench", "--engine", str(engine_dir), "--draft", str(random_draft_dir), "--device", "cpu",
              "--categories", "translation,code", "--limit", "1", "--max-new-tokens", "8", "--warmup", "1",
              "--methods", "ar,microspec", "--depth", "2", "--total-tokens", "8", "--concurrency", "1,2",
              "--spec-policy", "fixed", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    for name in ("ar", "microspec"):
        one, b = res["runs"][name]["batched"]
        assert one["concurrency"] == 1 and one["requests"] == 2
        assert [r["new_tokens"] for r in one["per_request"]] == [r["new_tokens"] for r in b["per_request"]]
        assert b["concurrency"] == 2 and b["requests"] == 2 and b["requests_per_s"] > 0 and b["output_tokens_per_s"] > 0
        assert one["mismatches"] == b["mismatches"] == 0 and "ids" not in b  # fp32: every request emits AR's tokens
        # the batch decodes what the one-at-a-time run decoded for each first turn
        alone = {t["qid"]: t["new_tokens"] for t in res["runs"][name]["turns"] if t["turn"] == 0}
        assert {r["qid"]: r["new_tokens"] for r in b["per_request"]} == alone
        for r in b["per_request"]:
            assert 0 < r["ttft_s"] <= r["latency_s"] <= b["wall_s"]
        # TTFT from submission: at concurrency 1 the second request waits for the first to finish, so its first
        # token comes after the first request's last (both submitted at once)
        assert one["per_request"][1]["ttft_s"] >= one["per_request"][0]["latency_s"] > 0
        assert one["ttft_s"]["p99"] >= one["per_request"][0]["latency_s"]
        for key in ("ttft_s", "itl_s", "latency_s"):
            p = b[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"], (name, key)
        assert b["ttft_s"]["p99"] <= b["latency_s"]["p99"]
        assert b["output_tokens_per_s"] == pytest.approx(sum(alone.values()) / b["wall_s"])
        assert f"[bench] {name}: 2 first turns at concurrency 2: " in log.getvalue()
    md = (tmp_path / "results.md").read_text()
    assert "## in-flight batching" in md and "shared by the tokens of the later step" in md
    assert "TTFT from submission, queueing included, both systems" in md
    table = md.split("## in-flight batching")[1].split("\n\n")[2].splitlines()
    assert [r.split(" | ")[:2] for r in table[2:]] == [["| ar", "1"], ["| ar", "2"], ["| microspec", "1"],
                                                      ["| microspec", "2"]]
    assert (tmp_path / "throughput_latency.png").exists()
    assert all(len(r.split("|")) == 23 for r in table)
    assert table[0].split(" | ")[5] == "TTFT from submission p50" and "latency from submission p50" in table[0]
    for r in table[2:]:  # every cell measured; AR has no acceptance, and every step of both ran one tree size
        cells = [c.strip() for c in r.split("|")[1:-1]]
        assert "-" not in cells[:19] and (cells[19] == "-") == (cells[0] == "ar"), cells
        assert cells[20].startswith("1: " if cells[0] == "ar" else "8: ") and "," not in cells[20], cells
    # every microspec request speculated (fixed: a tree always pays); the cell says how many decoded as AR's
    assert [b["steps"]["as_ar"] for b in res["runs"]["microspec"]["batched"]] == [0, 0]
    assert [b["steps"]["graph_first_uses"] for b in res["runs"]["microspec"]["batched"]] == [0, 0]  # no graphs
    assert [b["steps"]["step_costs"] for b in res["runs"]["microspec"]["batched"]] == [None, None]  # fixed: none
    for b in res["runs"]["ar"]["batched"] + res["runs"]["microspec"]["batched"]:  # submission, then the steps
        s = b["steps"]
        assert 0 < s["first_step_ms"] and 0 < s["steps_total_ms"] and s["first_step_ms"] + s["steps_total_ms"] <= \
            b["wall_s"] * 1e3
    from trtllm_microspec.bench.specbench import tree_cell
    assert tree_cell({"tree_sizes": {1: 5, 60: 3}, "as_ar": 2}) == "60: 3, 1: 5; 2 requests as AR's"


# ---- outside references: hf-compiled on the CPU, the conversions vLLM loads (vLLM itself runs on the GPU only)

def test_hf_compiled_equals_hf_with_one_compilation(engine_dir):
    from trtllm_microspec.bench.references import HFCompiled, HFReference

    hc = HFCompiled(str(engine_dir), "cpu", None)  # its eager model is the `hf` reference's
    for i, prompt in enumerate(["What is 2+2?", "Name three colours of the rainbow, please."]):
        # after the first prompt, a prompt of another length must reuse the compiled step
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = hc.generate(prompt, 8)
        want = HFReference.generate(hc, prompt, 8)
        assert got.token_ids == want.token_ids and got.num_new_tokens == 8, prompt
        assert got.stats["method"] == "hf-compiled" and got.stats["wall_s"] > 0


def test_bench_table_has_the_references(engine_dir, tmp_path):
    main(["bench", "--engine", str(engine_dir), "--device", "cpu", "--categories", "qa", "--limit", "1",
          "--max-new-tokens", "4", "--warmup", "1", "--methods", "ar,hf-compiled", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    ref = res["runs"]["hf-compiled"]["summary"]["overall"]
    assert list(res["runs"]) == ["ar", "hf-compiled"] and ref["new_tokens"] == 4
    speed = ref["speed"] / res["runs"]["ar"]["summary"]["overall"]["speed"]
    assert ref["speedup"] == pytest.approx(speed)
    md = (tmp_path / "results.md").read_text()
    assert f"| hf-compiled | {ref['speed']:.1f} | {ref['speed']:.1f} |" in md
    assert f"| hf-compiled | {ref['speedup']:.2f} | {ref['speedup']:.2f} |" in md


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_missing_is_a_one_line_error(tmp_path, capsys):
    for method in ("vllm", "vllm-eagle"):
        with pytest.raises(SystemExit) as e:
            main(["bench", "--device", "cpu", "--methods", f"ar,{method}", "--out", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("microspec: error: vllm is not installed")
        assert not (tmp_path / "results.json").exists()  # refused before any run


def test_references_import_no_vllm():
    """The bench and its references import vLLM only inside VLLMReference (a CPU machine has none)."""
    import subprocess
    import sys

    code = ("import sys, trtllm_microspec.bench.specbench, trtllm_microspec.bench.references; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


class _FakeVLLMEngine:
    """vLLM's LLMEngine as generate_at drives it: add_request, then step() -> the outputs of that step (DELTA: the
    new tokens), one token per running request per step, 2 ms a step."""

    def __init__(self):
        self.running, self.most = {}, 0

    def add_request(self, rid, prompt, sp):
        self.running[rid] = [sp.max_tokens, 0]
        self.most = max(self.most, len(self.running))

    def step(self):
        import time
        from types import SimpleNamespace

        time.sleep(0.002)
        outs = []
        for rid, st in list(self.running.items()):
            st[1] += 1
            done = st[1] == st[0]
            outs.append(SimpleNamespace(request_id=rid, finished=done,
                                        outputs=[SimpleNamespace(token_ids=[7])]))
            if done:
                del self.running[rid]
        return outs


def test_vllm_engine_loop_times_from_submission(monkeypatch):
    """VLLMReference.generate_at on a stand-in for vLLM's engine: at most `concurrency` in flight, every request
    timed from the call (its submission) by the bench's one timing function, so a queued request's TTFT includes its
    wait; the bench's summary of its Results is computed as for our engine's."""
    import sys
    import time
    from types import ModuleType, SimpleNamespace

    from trtllm_microspec.bench.references import VLLMReference
    from trtllm_microspec.bench.specbench import batch_summary

    fake = ModuleType("vllm.sampling_params")
    fake.RequestOutputKind = SimpleNamespace(DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake)
    ref = object.__new__(VLLMReference)
    ref.method, ref.max_len, ref.eos_ids = "vllm", 64, [0]
    ref.tokenizer = SimpleNamespace(prompts_ids=lambda ps, chat: [[1, 2, 3] for _ in ps],
                                    decode=lambda ids: "x" * len(ids))
    ref.SamplingParams, ref.TokensPrompt = SimpleNamespace, dict
    engine = _FakeVLLMEngine()
    ref.llm = SimpleNamespace(llm_engine=engine)
    t0 = time.perf_counter()
    results = ref.generate_at(["a", "b", "c"], 3, 1)
    wall = time.perf_counter() - t0
    assert engine.most == 1 and [r.num_new_tokens for r in results] == [3, 3, 3]
    assert all(sum(k for _, k in r.emits) == 3 for r in results)
    first, second, third = (r.stats for r in results)
    # queued behind the one before: its first token after that one's last, counted from the common submission
    assert second["ttft_s"] >= first["wall_s"] > first["ttft_s"] > 0 and third["ttft_s"] >= second["wall_s"]
    assert len(first["inter_token_s"]) == 2 and all(x > 0 for x in first["inter_token_s"])
    s = batch_summary([{"qid": q} for q in "abc"], results, t0, wall, 1)
    per = s["per_request"]
    assert per[1]["ttft_s"] >= per[0]["latency_s"] and per[2]["ttft_s"] >= per[1]["latency_s"]
    for p, r in zip(per, results):  # the bench's t0 is a little before the call's: the same times, a little longer
        assert r.stats["ttft_s"] <= p["ttft_s"] < r.stats["ttft_s"] + 0.5
        assert r.stats["wall_s"] <= p["latency_s"] <= wall
    assert s["ttft_s"]["p50"] == per[1]["ttft_s"] and s["itl_s"]["p50"] > 0


def test_engine_to_hf_dir_loads_in_transformers(engine_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trtllm_microspec import LLM
    from trtllm_microspec.bench.references import engine_to_hf

    d = engine_to_hf(engine_dir, tmp_path / "hf")
    assert json.loads((d / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    sd = hf.state_dict()
    engine = load_file(engine_dir / "model.safetensors")
    assert all(torch.equal(sd[f"model.{k}"], v.float()) for k, v in engine.items())
    assert torch.equal(hf.lm_head.weight, engine["embed_tokens.weight"].float())  # tied, as in the engine
    llm = LLM(str(engine_dir), method="ar", device="cpu")
    ours = llm.generate("Why is the sky blue?", 12, chat=True)
    ids = torch.tensor([llm.prompt_ids("Why is the sky blue?", chat=True)])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=read_config(engine_dir).eos_ids)
    assert out[0, ids.shape[1]:].tolist() == ours.token_ids and len(ours.token_ids) > 1


# what vLLM 0.26's EagleLlamaForCausalLM (model_executor/models/llama_eagle.py) loads for smollm2's head: fc without
# bias, one Llama layer with no input norm (an Identity there); embed_tokens and lm_head are the target's
SMOLLM2_EAGLE = {"fc.weight": (576, 1152), "layers.0.self_attn.q_proj.weight": (576, 576),
                 "layers.0.self_attn.k_proj.weight": (192, 576), "layers.0.self_attn.v_proj.weight": (192, 576),
                 "layers.0.self_attn.o_proj.weight": (576, 576), "layers.0.mlp.gate_proj.weight": (1536, 576),
                 "layers.0.mlp.up_proj.weight": (1536, 576), "layers.0.mlp.down_proj.weight": (576, 1536),
                 "layers.0.post_attention_layernorm.weight": (576,)}


def test_shipped_head_to_vllm_eagle(engine_dir, tmp_path):
    from safetensors.torch import load_file

    import trtllm_microspec
    from trtllm_microspec.bench.references import eagle_to_vllm

    head = Path(trtllm_microspec.__file__).parent / "drafts" / "smollm2-135m"
    out = eagle_to_vllm(head, engine_dir, tmp_path / "eagle")
    sd, src = load_file(out / "model.safetensors"), load_file(head / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in sd.items()} == SMOLLM2_EAGLE
    assert all(torch.equal(v, src[k]) for k, v in sd.items())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and not cfg["qkv_bias"] and not cfg["attention_bias"]
    assert "bias" not in cfg  # vLLM's Llama layer reads a "bias" key as "every attention projection has a bias"
    hf = json.loads((engine_dir / "source.json").read_text())["hf_config"]
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_parameters", "vocab_size"):
        assert cfg[k] == hf[k], k


def test_fc_bias_fold_is_exact(engine_dir, tmp_path):
    """A head with fc.bias b and Qwen-style q/k/v biases: vLLM's layer without fc.bias, with the folded biases,
    computes the same q/k/v and the same residual stream (fc output + attention output) as ours."""
    from safetensors.torch import load_file

    from trtllm_microspec.bench.references import eagle_to_vllm, vllm_eagle_params
    from trtllm_microspec.models.model import ModelConfig
    from trtllm_microspec.speculative.eagle import EagleDraft, draft_config, save_draft

    torch.manual_seed(0)
    cfg = draft_config(ModelConfig.load(engine_dir / "config.json"))
    cfg.attention_bias = True
    save_draft(EagleDraft(cfg, bias=True), tmp_path / "head", engine_dir)
    ours = {k: v.double() for k, v in load_file(tmp_path / "head" / "model.safetensors").items()}
    out = eagle_to_vllm(tmp_path / "head", engine_dir, tmp_path / "eagle")
    vcfg = json.loads((out / "config.json").read_text())
    assert vcfg["qkv_bias"] and vcfg["attention_bias"]
    theirs = {k: v.double() for k, v in load_file(out / "model.safetensors").items()}
    assert {k: tuple(v.shape) for k, v in theirs.items()} == vllm_eagle_params(vcfg)
    assert ours["fc.bias"].abs().max() > 0.01
    x = torch.randn(5, 2 * cfg.hidden_size, dtype=torch.float64)
    h_ours = x @ ours["fc.weight"].T + ours["fc.bias"]
    h_theirs = x @ theirs["fc.weight"].T
    p = "layers.0.self_attn."
    for n in ("q", "k", "v"):
        w = f"{p}{n}_proj.weight"
        want = h_ours @ ours[w].T + ours[f"{p}{n}_proj.bias"]
        got = h_theirs @ theirs[w].T + theirs[f"{p}{n}_proj.bias"]
        assert torch.allclose(got, want, rtol=0, atol=1e-5), n  # fp32 rounding of the folded bias only
    a = torch.randn(5, cfg.num_heads * cfg.head_dim, dtype=torch.float64)  # any attention output
    o = a @ ours[f"{p}o_proj.weight"].T
    assert torch.allclose(h_theirs + o + theirs[f"{p}o_proj.bias"], h_ours + o, rtol=0, atol=1e-12)


def test_timeline_trace_labels_every_step(engine_dir, tmp_path):
    """profile --timeline --trace: the traced pass's steps are all labelled (one prefill step with prompt chunks,
    the rest decode-only) and the report names the host ops that took their time."""
    out = tmp_path / "tl"
    main(["profile", "--engine", str(engine_dir), "--timeline", "--trace", "--batch", "2", "--context", "16",
          "--new-tokens", "3", "--out", str(out)])
    text = out.read_text()
    ranges = {line.split("|")[1].strip(): int(line.split("|")[2]) for line in text.splitlines()
              if line.startswith("| step with prompt chunks") or line.startswith("| decode-only step")}
    assert ranges["step with prompt chunks"] >= 1 and ranges["decode-only step"] >= 1
    assert "| aten::mm |" in text or "| aten::addmm |" in text or "| aten::linear |" in text


def test_kernels_in_ranges_by_time():
    """--trace's per-piece table gives a range the kernels that start inside it (the profiler's one clock; each
    range synchronizes at its ends on CUDA), not the ones the profiler links to its launches: on the H200 those
    links missed Triton's kernels and left the verify under its byte floor."""
    from trtllm_microspec.bench.profile import kernels_in, merged, total_of

    kernels = [(0.5, 1.0, "a"), (1.0, 2.0, "b"), (2.5, 4.0, "a"), (3.0, 8.0, "c"), (7.0, 16.0, "a"),
               (9.5, 32.0, "b")]  # (start, duration, name)
    assert total_of(kernels_in(kernels, [(1.0, 3.0), (7.0, 9.0)])) == (30.0, 4)  # the ends belong to the range
    assert kernels_in(kernels, [(7.0, 9.0), (1.0, 3.0)]) == {"a": [20.0, 2], "b": [2.0, 1], "c": [8.0, 1]}
    assert total_of(kernels_in(kernels, [(3.5, 6.0)])) == (0, 0) and kernels_in(kernels, []) == {}
    assert total_of(kernels_in(kernels, [(0.0, 10.0)])) == (63.0, 6)
    # a range nested in another (a draft layer call inside the draft tree) counts once in their union
    assert merged([(7.0, 8.0), (1.0, 3.0), (0.0, 2.0), (7.5, 9.0)]) == [(0.0, 3.0), (7.0, 9.0)]


def test_timeline_trace_round_pieces(engine_dir, tmp_path):
    """profile --timeline --trace --method microspec: the eager pass puts each of a round's pieces in its own
    range, once a round each, the draft layer once per depth step plus the accepted path's pass (the CPU tree:
    depth 3), and the wrapped functions are the originals again afterwards."""
    from trtllm_microspec.engine import spec_runner as runner_mod

    before = runner_mod.draft_trees, runner_mod.verify, runner_mod.accept
    out = tmp_path / "tl"
    main(["profile", "--engine", str(engine_dir), "--timeline", "--trace", "--method", "microspec", "--batch", "1",
          "--context", "16", "--new-tokens", "6", "--out", str(out)])
    assert (runner_mod.draft_trees, runner_mod.verify, runner_mod.accept) == before
    text = out.read_text()
    table = text.split("one round's pieces")[1].split("Each piece's largest kernels")[0]
    rows = {line.split("|")[1].strip().split(" (")[0]: float(line.split("|")[2]) for line in table.splitlines()
            if line.startswith("| ") and "---" not in line and not line.startswith("| piece")}
    assert rows["whole round"] == 1 and rows["draft tree"] == 1.0 and rows["verify"] == 1.0
    assert rows["accept"] == 1.0 and rows["window update"] == 1.0
    assert rows["draft layer"] >= 3 + 1  # depth steps + the accepted path (+ a catch-up after plain steps)
    # each piece against the bytes it must read: the verify the target's weights but its embedding table, a draft
    # layer call its one layer's; the round both; the bookkeeping pieces none
    from trtllm_microspec.models.model import ModelConfig

    cfg = ModelConfig.load(engine_dir / "config.json")
    floors = {line.split("|")[1].strip().split(" (")[0]: line.split("|")[6].strip() for line in table.splitlines()
              if line.startswith("| ") and "---" not in line and not line.startswith("| piece")}
    per_layer = 4 * cfg.hidden_size ** 2  # q|k|v|o at least
    assert float(floors["verify"]) * 4.2e12 / 1e6 > cfg.num_layers * per_layer * 2  # every layer's bytes
    assert float(floors["draft layer"]) > 0 and floors["accept"] == "-" and floors["window update"] == "-"
    assert float(floors["whole round"]) > float(floors["verify"])
    assert "Each piece's largest kernels" in text  # (the CPU has no kernels to list)
    # the step with the prompt, piece by piece: one target pass, its LM head, one top-K_pre, the draft pass over its
    # rows, the window's start
    prompt = {line.split("|")[1].strip().split(" (")[0]: float(line.split("|")[2]) for line in
              text.split("a step with prompt chunks piece by piece")[1].split("\n| the step's largest")[0].splitlines()
              if line.startswith("| ") and "---" not in line and not line.startswith("| piece")}
    assert prompt["whole step"] == 1 and prompt["target pass"] == 1.0 and prompt["window start"] == 1.0
    assert prompt["top-K over the vocabulary"] >= 1.0 and prompt["draft layer"] >= 1.0


def test_timeline_runs_every_request_to_its_budget(engine_dir, tmp_path, monkeypatch):
    """profile --timeline measures steps: a request runs its --new-tokens even where the model would end its answer
    (on the H200 random prompts ended after 4-6 steps, and the --trace pass's eager one before any round). Here
    every id is an end of answer, so without that every request would stop at its first token."""
    from trtllm_microspec.engine import scheduler as sched_mod

    init = sched_mod.Scheduler.__init__

    def every_id_stops(self, *args, **kw):
        init(self, *args, **kw)
        self.stop_ids = set(range(self.runner.target.cfg.vocab_size))

    monkeypatch.setattr(sched_mod.Scheduler, "__init__", every_id_stops)
    out = tmp_path / "tl"
    main(["profile", "--engine", str(engine_dir), "--timeline", "--batch", "2", "--context", "16", "--new-tokens", "5",
          "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["timeline"]
    assert sum(r["steps"] for r in rows if r["kind"] == "decode only") >= 4  # 5 tokens: the prefill's, 4 decodes


def test_timeline_requests_join_a_running_batch(engine_dir, tmp_path):
    """profile --timeline --requests: more requests than the batch, of random lengths, so later prompts join while
    others decode (the load bench's small mixed steps, which --batch alone never makes: its one prompt step comes
    before any decode); every request runs its budget."""
    out = tmp_path / "tl"
    main(["profile", "--engine", str(engine_dir), "--timeline", "--batch", "2", "--requests", "5", "--context", "16",
          "--new-tokens", "6", "--out", str(out)])
    steps = json.loads(out.with_suffix(".json").read_text())["steps"]["2"]
    mixed = [s for s in steps if s["chunks"] and s["decodes"]]
    assert mixed and max(s["decodes"] + s["chunks"] for s in steps) <= 2  # joins beside decodes; 2 at most running
    assert sum(s["chunks"] for s in steps) == 5 and len({s["prompt_tokens"] for s in steps if s["chunks"]}) > 1
    assert "5 requests of 4-16 random prompt tokens" in out.read_text()
    # AR overlaps its steps: each step's launch is timed apart from the wait for its tokens
    assert all(s["launch_ms"] is not None and 0 < s["launch_ms"] <= s["step_ms"] for s in steps)
    with pytest.raises(SystemExit):
        main(["profile", "--engine", str(engine_dir), "--timeline", "--requests", "-1"])


def test_timeline_reports_the_policys_costs_after_the_passes(engine_dir, tmp_path):
    """profile --timeline --spec-policy auto lists each shape's calibrated step cost beside the policy's estimate
    after the passes: a shape that ran steps at that bucket corrected by them, a tree that did not corrected as the
    plain shape there (the same ratio to its calibration), else left at its calibration."""
    out = tmp_path / "tl"
    main(["profile", "--engine", str(engine_dir), "--timeline", "--method", "microspec", "--spec-policy", "auto",
          "--batch", "1", "--context", "16", "--new-tokens", "8", "--out", str(out)])
    costs = [c for c in json.loads(out.with_suffix(".json").read_text())["costs"] if c["rows"] == 1]
    plain = [c for c in costs if c["shape"].startswith("plain")]
    assert len(plain) == 1 and len(costs) > 1  # every shape the policy weighed at one request
    assert any(c["own_steps"] for c in costs)  # the passes' steps corrected the shapes they ran
    scale = plain[0]["now_ms"] / plain[0]["ms"] if plain[0]["own_steps"] else 1.0
    for c in costs:
        if not c["own_steps"]:
            assert c["now_ms"] == pytest.approx(c["ms"] * scale)
    assert "| calibrated ms | after the passes ms | from its own steps |" in out.read_text()


def test_single_request_warmup_runs_every_measured_turn_once(engine_dir, tmp_path, monkeypatch):
    """--warmup: each measured turn (a two-turn MT-bench question: the second turn's conversation holds the first
    answer) is generated once unmeasured before its timed run, so the timed pass meets no first use of a CUDA graph;
    the records are the timed run's alone."""
    from trtllm_microspec.llm import LLM

    calls = []
    generate = LLM.generate

    def spy(self, prompt, max_new_tokens, *args, **kw):
        calls.append((json.dumps(prompt), max_new_tokens))
        return generate(self, prompt, max_new_tokens, *args, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    main(["bench", "--engine", str(engine_dir), "--device", "cpu", "--categories", "mt_bench", "--limit", "1",
          "--max-new-tokens", "3", "--warmup", "1", "--methods", "ar", "--out", str(tmp_path)])
    turns = [c for c in calls if c[0].startswith("[")]  # the conversations (the warm-up request is a string)
    assert len(turns) == 4 and turns[0] == turns[2] and turns[1] == turns[3], turns
    res = json.loads((tmp_path / "results.json").read_text())
    assert len(res["runs"]["ar"]["turns"]) == 2


@pytest.mark.parametrize("settles", [True, False])
def test_warmup_passes_until_no_graph_is_new(engine_dir, tmp_path, monkeypatch, settles):
    """Under `auto` a warm-up pass can meet CUDA-graph keys the one before did not (the policy's choices follow its
    state): the unmeasured passes repeat until one meets no first use (at most WARM_PASSES), and first uses left in
    the measured pass are counted in the run and named in the notes. The CPU has no graphs: first uses are faked
    here as one per conversation turn, in the first pass only (settles: a second pass meets none) or for ever."""
    from trtllm_microspec.bench.specbench import WARM_PASSES
    from trtllm_microspec.llm import LLM

    turns = []
    generate = LLM.generate

    def spy(self, prompt, max_new_tokens, *args, **kw):
        if not isinstance(prompt, str):
            turns.append(prompt)
        return generate(self, prompt, max_new_tokens, *args, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    monkeypatch.setattr(LLM, "graph_first_uses", lambda self: min(len(turns), 2) if settles else len(turns))
    main(["bench", "--engine", str(engine_dir), "--device", "cpu", "--categories", "mt_bench", "--limit", "1",
          "--max-new-tokens", "3", "--warmup", "1", "--methods", "ar", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    passes = 2 if settles else WARM_PASSES
    assert len(turns) == 2 * (passes + 1)  # two turns a pass, the measured pass last
    assert res["runs"]["ar"]["warm"] == {"passes": passes, "graph_first_uses": 0 if settles else 2}
    note = "ar: 2 CUDA-graph first uses (an eager step or a capture) in the measured pass"
    assert (note in (tmp_path / "results.md").read_text()) != settles


def test_batched_levels_count_graph_first_uses(engine_dir, tmp_path, monkeypatch):
    """--concurrency: the first uses of CUDA-graph keys in a level's measured pass (after its one unmeasured pass)
    are counted in its steps and named in the notes. The CPU has no graphs: faked here as one per batch the engine
    is given, so the measured pass meets one."""
    from trtllm_microspec.llm import LLM

    batches = []
    generate = LLM.generate

    def spy(self, prompt, max_new_tokens, *args, **kw):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            batches.append(len(prompt))
        return generate(self, prompt, max_new_tokens, *args, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    monkeypatch.setattr(LLM, "graph_first_uses", lambda self: len(batches))
    main(["bench", "--engine", str(engine_dir), "--device", "cpu", "--categories", "translation,code", "--limit", "1",
          "--max-new-tokens", "3", "--warmup", "1", "--methods", "ar", "--concurrency", "2", "--batched-only",
          "--out", str(tmp_path)])
    assert batches == [2, 2]  # the unmeasured pass, then the measured one
    level, = json.loads((tmp_path / "results.json").read_text())["runs"]["ar"]["batched"]
    assert level["steps"]["graph_first_uses"] == 1
    assert "ar at concurrency 2: 1 CUDA-graph first uses" in (tmp_path / "results.md").read_text()
