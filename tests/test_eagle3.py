"""EAGLE-3 heads (speculative/eagle3.py): a randomly initialised checkpoint written in each layout users bring
(SafeAILab EAGLE, SpecForge, vLLM speculators: keys, shapes and config as each source defines them) loads with
build_draft, and eagle / frspec / microspec over it emit exactly AR's tokens, one request and a batch; a draft
vocabulary that lacks a token never proposes it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_microspec.llm import LLM
from trtllm_microspec.models.model import ModelConfig
from trtllm_microspec.models.registry import UserError
from trtllm_microspec.speculative.eagle import build_draft
from trtllm_microspec.speculative.eagle3 import LAYOUTS

PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea."]
N = 24
TREE = dict(depth=2, top_k=4, total_tokens=10)


def eagle3_checkpoint(engine_dir, out, layout: str, draft_ids: torch.Tensor, hidden_size=None, seed=0):
    """A random EAGLE-3 head for the engine's target, written as `layout` writes it. draft_ids: the target ids of
    the draft vocabulary (sorted, as SafeAILab's and SpecForge's vocabulary pruning orders them)."""
    g = torch.Generator().manual_seed(seed)
    t = ModelConfig.load(engine_dir / "config.json")
    d, hd, V, Vd = t.hidden_size, t.head_dim, t.vocab_size, draft_ids.numel()

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    prefix = "layers.0." if layout == LAYOUTS[2] else "midlayer."
    sd = {"fc.weight": w(d, 3 * (hidden_size or d)), "norm.weight": torch.ones(d, dtype=torch.bfloat16),
          "lm_head.weight": w(Vd, d), "d2t": draft_ids - torch.arange(Vd),
          "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, draft_ids, True)}
    layer = {"self_attn.q_proj.weight": w(t.num_heads * hd, 2 * d), "self_attn.k_proj.weight": w(t.num_kv_heads * hd, 2 * d),
             "self_attn.v_proj.weight": w(t.num_kv_heads * hd, 2 * d), "self_attn.o_proj.weight": w(d, t.num_heads * hd),
             "mlp.gate_proj.weight": w(t.intermediate_size, d), "mlp.up_proj.weight": w(t.intermediate_size, d),
             "mlp.down_proj.weight": w(d, t.intermediate_size), "input_layernorm.weight": 1 + w(d),
             "hidden_norm.weight": 1 + w(d), "post_attention_layernorm.weight": 1 + w(d)}
    sd.update({prefix + k: v for k, v in layer.items()})
    llama = {"model_type": "llama", "hidden_size": d, "intermediate_size": t.intermediate_size,
             "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "num_hidden_layers": 1,
             "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta, "max_position_embeddings": t.max_seq_len,
             "vocab_size": V, "hidden_act": "silu", "tie_word_embeddings": False}
    out.mkdir(parents=True)
    if layout == LAYOUTS[0]:  # SafeAILab: a Llama config plus draft_vocab_size, pytorch_model.bin, no embedding
        cfg = {**llama, "architectures": ["LlamaForCausalLM"], "draft_vocab_size": Vd}
        torch.save(sd, out / "pytorch_model.bin")
    else:  # SpecForge and speculators save the (frozen) copy of the target's embedding too
        sd["embed_tokens.weight"] = load_file(engine_dir / "model.safetensors")["embed_tokens.weight"]
        if layout == LAYOUTS[1]:
            cfg = {**llama, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": Vd}
        else:  # speculators: the layer's config as a diff against LlamaConfig's defaults, the rest at the top
            cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                   "transformer_layer_config": {k: v for k, v in llama.items() if k != "hidden_act"},
                   "draft_vocab_size": Vd, "norm_before_residual": True, "target_hidden_size": hidden_size,
                   "eagle_aux_hidden_state_layer_ids": [1, t.num_layers // 2, t.num_layers - 4],
                   "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                          "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                       "architectures": ["LlamaForCausalLM"]}}}
        save_file(sd, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg))


def some_ids(engine_dir, n=2048, seed=0):
    V = ModelConfig.load(engine_dir / "config.json").vocab_size
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n].sort().values


def spy(vocab, seen: list) -> None:
    """Record the ids every draft-head call of `vocab` proposes (a round makes its head by head_for)."""
    head_for = vocab.head_for

    def made(*args):
        head = head_for(*args)

        def recorded(*args):
            logp, ids = head(*args)
            seen.append(ids[logp > float("-inf")])  # an empty slot (-inf) is no proposal
            return logp, ids
        return recorded
    vocab.head_for = made


@pytest.fixture(scope="module")
def ar(engine_dir):
    llm = LLM(engine_dir, "ar", device="cpu")
    return [r.token_ids for r in llm.generate(PROMPTS, N, chat=True)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_loads_and_is_lossless(engine_dir, ar, tmp_path, layout):
    ids = some_ids(engine_dir)
    ids = torch.unique(torch.cat([ids, torch.tensor(sum(ar, []))]))  # covers AR's tokens: some drafts accepted
    eagle3_checkpoint(engine_dir, tmp_path / "ck", layout, ids)
    out, what = build_draft(tmp_path / "ck", engine_dir, tmp_path / "draft")
    assert what.startswith(layout) and f"draft vocabulary {ids.numel()}" in what
    raw = json.loads((out / "config.json").read_text())
    assert raw["eagle"] == 3 and raw["layout"] == layout
    L = ModelConfig.load(engine_dir / "config.json").num_layers
    assert raw["taps"] == ([1, L // 2, L - 4] if layout == LAYOUTS[2] else [2, L // 2, L - 3])
    assert "embed_tokens.weight" not in load_file(out / "model.safetensors")  # the target's own: dropped
    for method in ("eagle", "frspec", "microspec"):
        llm = LLM(engine_dir, method, draft=out, device="cpu", spec_policy="fixed", **TREE)  # every step a round
        single = llm.generate(PROMPTS[0], N, chat=True)
        assert single.token_ids == ar[0], method
        assert single.stats["rounds"] < N  # a random head's drafts are still accepted at times
        assert [r.token_ids for r in llm.generate(PROMPTS, N, chat=True)] == ar, method
        assert llm.target.tapped.shape[-1] == 3 * llm.target.cfg.hidden_size


@pytest.mark.parametrize("method", ["frspec", "microspec", "ctx-only", "ext-only", "naive"])
def test_every_shape_and_ablation_equals_ar(engine_dir, ar, tmp_path, method):
    """The one engine's other paths over an EAGLE-3 head: the speculation policy made to cycle through plain rows
    (the draft fed its three tapped layers of a one-row pass) and every tree it may pick, for frspec (its own
    vocabulary) and the windows and their ablations over the draft vocabulary: AR's tokens, alone and batched,
    every shape run."""
    import itertools

    ids = torch.unique(torch.cat([some_ids(engine_dir), torch.tensor(sum(ar, []))]))
    eagle3_checkpoint(engine_dir, tmp_path / "ck", LAYOUTS[1], ids)
    out, _ = build_draft(tmp_path / "ck", engine_dir, tmp_path / "draft")
    llm = LLM(engine_dir, method, draft=out, device="cpu", max_batch=4, depth=3, top_k=4, total_tokens=16)
    runner = llm.scheduler().runner
    assert len(runner.shapes) >= 3 and runner.shapes[0] is None  # plain rows, a smaller tree, the configured one
    cycle = itertools.cycle(range(len(runner.shapes)))
    runner.policy.choose = lambda reqs, rows: next(cycle)
    assert llm.generate(PROMPTS[0], N, chat=True).token_ids == ar[0], method
    results = llm.generate(PROMPTS, N, chat=True)
    assert [r.token_ids for r in results] == ar, method
    assert set(results[0].stats["tree_sizes"]) == {t.total_tokens if t else 1 for t in runner.shapes}
    assert results[0].stats["rounds"] > 0


@pytest.mark.parametrize("method", ["eagle", "microspec"])
def test_missing_token_never_proposed(engine_dir, ar, tmp_path, method):
    """The draft vocabulary lacks every token AR emits: the heads never propose one (single and batched), and
    the output is still AR's. The control head has them all: MicroSpec's window, 8 ids wide here (the last of the
    stream: the target's top ids at the accepted positions), then proposes them (a random head over all 49k ids
    rarely would, so eagle has no control)."""
    emitted = torch.tensor(sorted(set(sum(ar, []))))
    every = torch.arange(ModelConfig.load(engine_dir / "config.json").vocab_size)
    kept = every[~torch.isin(every, emitted)]
    proposed = {}
    for name, ids in (("lacking", kept), ("control", every)):
        eagle3_checkpoint(engine_dir, tmp_path / name, LAYOUTS[0], ids)
        out, _ = build_draft(tmp_path / name, engine_dir, tmp_path / f"{name}-draft")
        llm = LLM(engine_dir, method, draft=out, device="cpu", w_max=8, spec_policy="fixed", **TREE)
        seen = []
        spy(llm.scheduler().runner.vocab, seen)  # the one engine: a request alone runs as a batch of one
        assert llm.generate(PROMPTS[0], N, chat=True).token_ids == ar[0]
        assert [r.token_ids for r in llm.generate(PROMPTS, N, chat=True)] == ar
        proposed[name] = set(torch.cat([s.flatten() for s in seen]).tolist())
    assert not proposed["lacking"] & set(emitted.tolist())
    assert proposed["lacking"] <= set(kept.tolist())
    if method == "microspec":
        assert proposed["control"] & set(emitted.tolist())


def test_refuses_a_head_for_another_target(engine_dir, tmp_path):
    eagle3_checkpoint(engine_dir, tmp_path / "ck", LAYOUTS[1], some_ids(engine_dir), hidden_size=1024)
    with pytest.raises(UserError, match="hidden size 1024"):
        build_draft(tmp_path / "ck", engine_dir, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


def test_train_eagle3_head(engine_dir, tmp_path):
    """train-draft --arch eagle3: a few steps on real ShareGPT conversations lower the held-out loss; the head is an
    EAGLE-3 head over the --loss-vocab most frequent answer ids (EOS among them), loads and is lossless."""
    from trtllm_microspec.data import sharegpt_conversations
    from trtllm_microspec.train.train_draft import train

    convs = [[{**m, "content": m["content"][:100]} for m in c[:2]] for c in sharegpt_conversations(8)]
    r = train(engine_dir, tmp_path / "h3", data=convs, max_len=160, steps=4, lr=1e-3, batch_tokens=320, ttt_steps=2,
              seed=3, device="cpu", save_every=0, heldout=0.25, loss="pruned", loss_vocab=4096, arch="eagle3")
    assert r["arch"] == "eagle3" and r["steps"] == 4
    assert r["heldout_loss"] < r["heldout_loss_start"] - 0.1
    raw = json.loads((tmp_path / "h3" / "config.json").read_text())
    assert raw["eagle"] == 3 and raw["draft_vocab_size"] == 4096
    sd = load_file(tmp_path / "h3" / "model.safetensors")
    ids = torch.arange(4096) + sd["d2t"]
    eos = ModelConfig.load(engine_dir / "config.json").eos_ids
    assert set(eos) <= set(ids.tolist())
    ar = LLM(engine_dir, "ar", device="cpu").generate(PROMPTS[0], N, chat=True)
    spec = LLM(engine_dir, "microspec", draft=tmp_path / "h3", device="cpu", **TREE).generate(PROMPTS[0], N, chat=True)
    assert spec.token_ids == ar.token_ids


def test_vllm_export_reads_back(engine_dir, tmp_path):
    """bench's vllm-eagle reference writes an EAGLE-3 head in SafeAILab's layout (vLLM's eagle3 method): read back
    by build_draft, it is the same head."""
    from trtllm_microspec.bench.references import eagle3_to_vllm
    from trtllm_microspec.speculative.eagle3 import random_head

    head = random_head(engine_dir, tmp_path / "head", 1000)
    eagle3_to_vllm(head, tmp_path / "vllm")
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["draft_vocab_size"] == 1000
    out, what = build_draft(tmp_path / "vllm", engine_dir, tmp_path / "back")
    assert what.startswith(LAYOUTS[0])
    want, got = load_file(head / "model.safetensors"), load_file(out / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert json.loads((out / "config.json").read_text())["taps"] == json.loads((head / "config.json").read_text())["taps"]
