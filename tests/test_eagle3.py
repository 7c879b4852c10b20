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


def eagle3_checkpoint(engine_dir, out, layout: str, draft_ids: torch.Tensor, hidden_size=None, seed=0,
                      kv_heads=None, head_dim=None, config=None):
    """A random EAGLE-3 head for the engine's target, written as `layout` writes it. draft_ids: the target ids of
    the draft vocabulary (sorted, as SafeAILab's and SpecForge's vocabulary pruning orders them); kv_heads and
    head_dim: the layer's attention shape (default: the target's). config: keys set in (None: removed from) its
    config.json."""
    g = torch.Generator().manual_seed(seed)
    t = ModelConfig.load(engine_dir / "config.json")
    d, hd, V, Vd = t.hidden_size, head_dim or t.head_dim, t.vocab_size, draft_ids.numel()
    kvh = kv_heads or t.num_kv_heads

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    prefix = "layers.0." if layout == LAYOUTS[2] else "midlayer."
    sd = {"fc.weight": w(d, 3 * (hidden_size or d)), "norm.weight": torch.ones(d, dtype=torch.bfloat16),
          "lm_head.weight": w(Vd, d), "d2t": draft_ids - torch.arange(Vd),
          "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, draft_ids, True)}
    layer = {"self_attn.q_proj.weight": w(t.num_heads * hd, 2 * d), "self_attn.k_proj.weight": w(kvh * hd, 2 * d),
             "self_attn.v_proj.weight": w(kvh * hd, 2 * d), "self_attn.o_proj.weight": w(d, t.num_heads * hd),
             "mlp.gate_proj.weight": w(t.intermediate_size, d), "mlp.up_proj.weight": w(t.intermediate_size, d),
             "mlp.down_proj.weight": w(d, t.intermediate_size), "input_layernorm.weight": 1 + w(d),
             "hidden_norm.weight": 1 + w(d), "post_attention_layernorm.weight": 1 + w(d)}
    sd.update({prefix + k: v for k, v in layer.items()})
    llama = {"model_type": "llama", "hidden_size": d, "intermediate_size": t.intermediate_size,
             "num_attention_heads": t.num_heads, "num_key_value_heads": kvh, "head_dim": hd, "num_hidden_layers": 1,
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
    cfg = {k: v for k, v in {**cfg, **(config or {})}.items() if v is not None}
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


def test_taps_are_the_streams_entering_layers(engine_dir):
    """Transformer.taps against transformers on the same weights: tap i is the residual stream entering layer i
    (output_hidden_states[i]: the embedding output at 0, what SafeAILab's and vLLM's loops keep before layer i)
    and the output of decoder layer i - 1 (what SpecForge's forward hook on layers[i - 1] captures); tap L is the
    last layer's output before the final norm."""
    from test_model import TEXT, Ours, hf_reference

    ours = Ours(engine_dir, None)
    L = ours.model.cfg.num_layers
    taps = (0, 2, L // 2, L - 3, L)
    ids = torch.tensor(ours.tok.encode(TEXT)[:32])
    ref = hf_reference(engine_dir, None)
    hooked = {}
    for i in taps[1:]:  # SpecForge's capture: the output of decoder layer i - 1
        ref.model.layers[i - 1].register_forward_hook(
            lambda m, args, out, i=i: hooked.__setitem__(i, out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        want = ref(ids[None], output_hidden_states=True).hidden_states
        ours.model.taps = taps
        ours.prefill(ids)
    got = ours.model.tapped.view(len(ids), len(taps), -1)
    for j, i in enumerate(taps):
        ref_i = hooked[i][0] if i else want[0][0]
        torch.testing.assert_close(got[:, j], ref_i, atol=2e-4, rtol=2e-4, msg=f"tap {i}")
        if i < L:  # (transformers' hidden_states[L] is after the final norm)
            torch.testing.assert_close(got[:, j], want[i][0], atol=2e-4, rtol=2e-4, msg=f"tap {i}")
    assert not torch.allclose(got[:, 1], got[:, 2])  # distinct layers: a shift would be seen


def _taps(engine_dir, tmp_path, layout, config):
    eagle3_checkpoint(engine_dir, tmp_path / "ck", layout, some_ids(engine_dir, 256), config=config)
    out, what = build_draft(tmp_path / "ck", engine_dir, tmp_path / "draft")
    taps = json.loads((out / "config.json").read_text())["taps"]
    assert what.endswith(f"target layers {taps})")
    return taps


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_ids_from_the_config(engine_dir, tmp_path, layout):
    """Which target layers a checkpoint's head reads, per layout (Transformer.taps numbering, pinned above): none
    named -> EAGLE-3's (2, L // 2, L - 3); top-level eagle_aux_hidden_state_layer_ids (vLLM, speculators: the
    stream entering the layer) as written; SpecForge's eagle_config ones (the layer whose output it is) + 1."""
    L = ModelConfig.load(engine_dir / "config.json").num_layers
    none = {"eagle_aux_hidden_state_layer_ids": None}
    assert _taps(engine_dir, tmp_path / "default", layout, none) == [2, L // 2, L - 3]
    assert _taps(engine_dir, tmp_path / "top", layout, {"eagle_aux_hidden_state_layer_ids": [1, 9, L]}) == [1, 9, L]
    if layout != LAYOUTS[2]:  # SpecForge's key (speculators has none); its default ids are EAGLE-3's layers
        nested = {**none, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4]}}
        assert _taps(engine_dir, tmp_path / "nested", layout, nested) == [2, L // 2, L - 3]
        nested = {**none, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 9, L - 1]}}
        assert _taps(engine_dir, tmp_path / "nested2", layout, nested) == [1, 10, L]
        with pytest.raises(UserError, match="this target has"):  # output of layer L: there is none
            _taps(engine_dir, tmp_path / "past", layout, {**none, "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [1, 9, L]}})
    with pytest.raises(UserError, match="not in increasing order"):
        _taps(engine_dir, tmp_path / "order", layout, {"eagle_aux_hidden_state_layer_ids": [9, 1, 20]})


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
    runner.policy.choose = lambda reqs, rows, riders=0: next(cycle)
    assert llm.generate(PROMPTS[0], N, chat=True).token_ids == ar[0], method
    results = llm.generate(PROMPTS, N, chat=True)
    assert [r.token_ids for r in results] == ar, method
    assert set(results[0].stats["tree_sizes"]) == {t.total_tokens if t else 1 for t in runner.shapes}
    assert results[0].stats["rounds"] > 0


def test_kv_pool_sized_with_the_heads_own_kv_shape(engine_dir, ar, tmp_path):
    """An EAGLE-3 head whose layer has other KV heads and head_dim than the target's (9 x 96 against 3 x 64): the
    engine plans each block of its pool with the target's and the head's own KV shapes, so the pools it allocates
    are exactly the blocks the --kv-memory budget buys and fit in it; and its tokens are AR's."""
    from trtllm_microspec.engine.block_manager import GIB

    ids = torch.unique(torch.cat([some_ids(engine_dir), torch.tensor(sum(ar, []))]))
    eagle3_checkpoint(engine_dir, tmp_path / "ck", LAYOUTS[1], ids, kv_heads=9, head_dim=96)
    out, _ = build_draft(tmp_path / "ck", engine_dir, tmp_path / "draft")
    budget = 0.02  # GiB
    llm = LLM(engine_dir, "eagle", draft=out, device="cpu", kv_memory=budget, spec_policy="fixed", **TREE)
    runner = llm.scheduler().runner
    t, h = runner.target.cfg, runner.draft.cfg
    assert (h.num_kv_heads, h.head_dim) == (9, 96) and (t.num_kv_heads, t.head_dim) == (3, 64)
    allocated = sum(x.nbytes for pool in (runner.cache, runner.dcache) for x in (pool.k, pool.v, pool.pos))
    assert allocated == runner.blocks.num_blocks * runner.block_bytes
    assert budget * GIB - runner.block_bytes < allocated <= budget * GIB
    assert [r.token_ids for r in llm.generate(PROMPTS, N, chat=True)] == ar
    # the prompt passes padded as their CUDA graphs replay them: attention's tile lists for both head groupings
    # (the target's 3 query heads a kv head, the head's 1) in the pass's buffer
    runner.graph_rows = runner.max_num_tokens
    assert runner.graph_G == [1, 3]
    assert [r.token_ids for r in llm.generate(PROMPTS, N, chat=True)] == ar
    assert runner.spec_out


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


@pytest.mark.parametrize("layout,value", [(LAYOUTS[1], False), (LAYOUTS[2], True)])
def test_refuses_norm_output_it_does_not_run(engine_dir, tmp_path, layout, value):
    """norm_output off the layout's default: SpecForge's false (lm_head over the un-normed output), speculators'
    true (the normed output fed to the next step): a clear error, not a head that drafts from other features."""
    assert _taps(engine_dir, tmp_path / "ok", layout, {"norm_output": not value})  # the default: loads
    with pytest.raises(UserError, match="norm_output"):
        _taps(engine_dir, tmp_path / "no", layout, {"norm_output": value})


def test_train_eagle3_head(engine_dir, tmp_path):
    """train-draft --arch eagle3: a few steps on real ShareGPT conversations lower the held-out loss; the head is an
    EAGLE-3 head over the --loss-vocab most frequent answer ids (EOS among them), its LM head trained away from the
    target's rows it starts as, and loads and is lossless."""
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
    tw = load_file(engine_dir / "model.safetensors")
    rows = tw.get("lm_head.weight", tw["embed_tokens.weight"])[ids].float()
    moved = (sd["lm_head.weight"].float() - rows).abs().amax(-1)
    assert (moved > 0).float().mean() > 0.9 and float(moved.max()) > 1e-3
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
