"""Outside references for `microspec bench`, measured in the same run on the engine's own weights and token ids:

- `hf`: transformers' eager `generate`;
- `hf-compiled`: transformers' model with a StaticCache and a torch.compile'd one-token decode step (gpt-fast style);
- `vllm` / `vllm-eagle`: vLLM (batch 1, greedy), plain or with our EAGLE head, on the engine converted to a Hugging
  Face directory (and the head to vLLM's EAGLE layout). vLLM runs where it is importable (a CUDA machine with vLLM 0.26).

Each has `device`, `engine_dir` and `generate(prompt, max_new_tokens, chat) -> Result` like our `LLM`, stops at the
engine's EOS ids (the EOS token included, as our engine does) and reports new_tokens and wall_s.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..models.registry import UserError

HF, HF_COMPILED, VLLM, VLLM_EAGLE = "hf", "hf-compiled", "vllm", "vllm-eagle"
REFERENCES = (HF, HF_COMPILED, VLLM, VLLM_EAGLE)
MAX_CACHE = 4096  # hf-compiled's and vLLM's context: every bench prompt fits, and one cache serves all prompts
# the Hugging Face / vLLM class of each engine family (source.json keeps the original HF config)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# vLLM reads these environment variables at import; its FlashInfer sampler is off (the bench does not need
# flashinfer installed), and in-process
# engines keep the bench in one process (the bench times each request with perf_counter around generate)
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}


def make_reference(method: str, a):
    """The reference `method` for the bench's arguments `a`."""
    if method == HF:
        return HFReference(a.engine, a.device, a.dtype)
    if method == HF_COMPILED:
        return HFCompiled(a.engine, a.device, a.dtype, a.max_seq_len)
    return VLLMReference(a.engine, a.device, a.dtype, a.max_seq_len, eagle=method == VLLM_EAGLE, draft=a.draft,
                         depth=a.depth, max_num_seqs=max(a.concurrency or [32]), prefix_cache=a.prefix_cache)


def hf_config(engine_dir: Path) -> dict:
    return dict(json.loads((engine_dir / "source.json").read_text())["hf_config"])


def hf_state_dict(engine_dir: Path) -> dict[str, torch.Tensor]:
    """The engine's tensors under transformers' names (the engine drops the "model." prefix)."""
    from safetensors.torch import load_file

    return {k if k.startswith("lm_head.") else f"model.{k}": v
            for k, v in load_file(engine_dir / "model.safetensors").items()}


def _result(tokenizer, new: list[int], method: str, t0: float):
    from ..llm import Result

    return Result(text=tokenizer.decode(new), token_ids=new, num_new_tokens=len(new),
                  stats={"method": method, "new_tokens": len(new), "wall_s": time.perf_counter() - t0})


class HFReference:
    """transformers' own `generate` on the engine's dense weights."""
    method = HF

    def __init__(self, engine: str, device: str | None, dtype: str | None):
        import transformers

        from ..engine.loader import pick_device, read_config
        from ..llm import resolve_engine
        from ..models.tokenizer import Tokenizer

        self.engine_dir = d = resolve_engine(engine)
        self.device, dtype = pick_device(device, dtype)
        hf = hf_config(d)
        cfg = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
        with torch.device(self.device):
            self.model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        missing, unexpected = self.model.load_state_dict(hf_state_dict(d), strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
        if missing or unexpected:
            raise UserError(f"{d} does not map onto transformers' {cfg.model_type}: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
        self.tokenizer = Tokenizer(d)
        self.cfg = read_config(d)
        self.eos_ids = self.cfg.eos_ids

    @torch.inference_mode()
    def generate(self, prompt, max_new_tokens: int, chat: bool = True):
        ids = torch.tensor([self.tokenizer.prompt_ids(prompt, chat)], device=self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0])
        return _result(self.tokenizer, out[0, ids.shape[1]:].tolist(), self.method, t0)


class HFCompiled(HFReference):
    """transformers' model with a StaticCache and a torch.compile'd one-token greedy step, written like gpt-fast:
    the prompt is prefilled eagerly (its length varies), then every new token is one call of the compiled step on
    [1, 1] tensors against the same cache, so one compilation serves every prompt. CUDA: mode reduce-overhead
    (CUDA graphs); CPU: the default mode (inductor, C++ built with the local compiler)."""
    method = HF_COMPILED

    def __init__(self, engine: str, device: str | None, dtype: str | None, max_seq_len: int | None = None):
        import transformers

        super().__init__(engine, device, dtype)
        self.max_len = min(max_seq_len or self.cfg.max_seq_len, MAX_CACHE)
        self.cache = transformers.StaticCache(config=self.model.config, max_cache_len=self.max_len)
        # transformers 5.17 names the forward's cache argument past_key_values; later versions call it cache
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = {("cache" if "cache" in params else "past_key_values"): self.cache}
        self.cuda = self.device.type == "cuda"
        self.step = torch.compile(self._step, mode="reduce-overhead" if self.cuda else None, fullgraph=True)

    def _step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        logits = self.model(token, position_ids=position, use_cache=True, **self.cache_arg).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def generate(self, prompt, max_new_tokens: int, chat: bool = True):
        ids = self.tokenizer.prompt_ids(prompt, chat)
        if len(ids) >= self.max_len:
            raise UserError(f"the prompt has {len(ids)} tokens; hf-compiled's cache holds {self.max_len}")
        t0 = time.perf_counter()
        self.cache.reset()
        x = torch.tensor([ids], device=self.device)
        logits = self.model(x, use_cache=True, logits_to_keep=1, **self.cache_arg).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        position = torch.tensor([[len(ids)]], device=self.device)
        new = [token.item()]
        while len(new) < min(max_new_tokens, self.max_len - len(ids)) and new[-1] not in self.eos_ids:
            if self.cuda:  # the previous step's output has been read: its graph buffers may be reused
                torch.compiler.cudagraph_mark_step_begin()
            token = self.step(token, position).clone()
            position += 1
            new.append(token.item())
        return _result(self.tokenizer, new, self.method, t0)


def engine_to_hf(engine_dir: Path, out: Path) -> Path:
    """Engine -> a Hugging Face model directory (config.json, model.safetensors, tokenizer.json) that vLLM and
    transformers' from_pretrained load. Tensors keep their dtype (the engine's)."""
    from safetensors.torch import save_file

    hf = hf_config(engine_dir)
    if hf["model_type"] not in ARCHITECTURES:
        raise UserError(f"no Hugging Face class known for model type {hf['model_type']!r}")
    sd = hf_state_dict(engine_dir)
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(engine_dir / "tokenizer.json", out / "tokenizer.json")
    # config.json last: it is what marks the directory as a model
    (out / "config.json").write_text(json.dumps(
        {**hf, "architectures": [ARCHITECTURES[hf["model_type"]]], "dtype": dtype, "torch_dtype": dtype}, indent=2))
    return out


def vllm_eagle_params(draft_cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensors vLLM 0.26's EagleLlamaForCausalLM loads from a checkpoint, with their shapes: fc without bias,
    one Llama decoder layer whose input norm is an Identity (so it has no weight), q/k/v biases if `qkv_bias`,
    an o_proj bias if `attention_bias`; embed_tokens and lm_head come from the target. Its load_weights silently
    skips names it does not know, so a tensor under another name would be lost, not rejected."""
    c = draft_cfg
    h, hd, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    p = "layers.0."
    shapes = {"fc.weight": (h, 2 * h), f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
              f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
              f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h), f"{p}mlp.down_proj.weight": (h, i),
              f"{p}post_attention_layernorm.weight": (h,)}
    if c["qkv_bias"]:
        shapes.update({f"{p}self_attn.q_proj.bias": (q,), f"{p}self_attn.k_proj.bias": (kv,),
                       f"{p}self_attn.v_proj.bias": (kv,)})
    if c["attention_bias"]:
        shapes[f"{p}self_attn.o_proj.bias"] = (h,)
    return shapes


def eagle_to_vllm(draft_dir: Path, engine_dir: Path, out: Path) -> Path:
    """Our EAGLE head -> vLLM 0.26's EAGLE layout. vLLM maps method "eagle" + architecture X to EagleX, and only
    EagleLlamaForCausalLM exists, so the head is written as a Llama-architecture layer: Qwen2's q/k/v biases
    through `qkv_bias`, and an fc.bias b (vLLM's fc has none) folded exactly: the layer's input is fc(x) + b, its
    first use is q/k/v (no input norm), so W_{q,k,v} b joins their biases, and the residual stream gets the
    missing + b back through an o_proj bias of b (attention output + residual is all the rest of the layer sees)."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((draft_dir / "config.json").read_text())
    if raw["arch"] not in ("llama", "qwen2"):
        raise UserError(f"vllm-eagle: vLLM has no EAGLE layer for a {raw['arch']} head (llama and qwen2 only)")
    sd = load_file(draft_dir / "model.safetensors")
    p = "layers.0.self_attn."
    b = sd.pop("fc.bias", None)
    if b is not None:
        b = b.float()
        for n in ("q", "k", "v"):
            w = sd[f"{p}{n}_proj.weight"].float()
            old = sd.get(f"{p}{n}_proj.bias")
            sd[f"{p}{n}_proj.bias"] = w @ b + (0 if old is None else old.float())
        sd[f"{p}o_proj.bias"] = b
    hf = hf_config(engine_dir)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
            "max_position_embeddings", "bos_token_id", "eos_token_id")
    cfg = {k: hf[k] for k in keys if k in hf}
    cfg.setdefault("head_dim", raw["head_dim"])
    # a "bias" key would turn on every attention bias in vLLM's Llama layer: it is not written
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
               qkv_bias=f"{p}q_proj.bias" in sd, attention_bias=f"{p}o_proj.bias" in sd, mlp_bias=False,
               tie_word_embeddings=False, dtype=raw["dtype"], torch_dtype=raw["dtype"])
    want = vllm_eagle_params(cfg)
    if set(sd) != set(want):
        raise UserError(f"{draft_dir}: tensors {sorted(set(sd) ^ set(want))[:4]} do not fit vLLM's EAGLE layer")
    out.mkdir(parents=True, exist_ok=True)
    # folded biases stay fp32 (vLLM casts on load): the fold itself adds no rounding
    save_file({k: v.contiguous() for k, v in sd.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def eagle3_to_vllm(draft_dir: Path, out: Path) -> Path:
    """Our EAGLE-3 head -> SafeAILab's layout, which vLLM loads with method "eagle3" (its llama_eagle3.py:
    `midlayer.` read as layers.0, d2t as its draft-to-target map, the three target layers from
    `eagle_aux_hidden_state_layer_ids`, the target's embedding when the head has none)."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((draft_dir / "config.json").read_text())
    sd = {k.replace("layers.0.", "midlayer.", 1): v for k, v in load_file(draft_dir / "model.safetensors").items()}
    V = raw["vocab_size"]
    sd["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.arange(sd["d2t"].numel()) + sd["d2t"], True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": raw["hidden_size"],
           "intermediate_size": raw["intermediate_size"], "num_attention_heads": raw["num_heads"],
           "num_key_value_heads": raw["num_kv_heads"], "head_dim": raw["head_dim"], "num_hidden_layers": 1,
           "rms_norm_eps": raw["rms_norm_eps"], "rope_theta": raw["rope_theta"], "hidden_act": "silu",
           "max_position_embeddings": raw["max_seq_len"], "vocab_size": V,
           "draft_vocab_size": raw["draft_vocab_size"], "target_hidden_size": raw["target_hidden_size"],
           "eagle_aux_hidden_state_layer_ids": raw["taps"], "norm_before_residual": raw["norm_before_residual"],
           "tie_word_embeddings": False, "attention_bias": False, "dtype": raw["dtype"], "torch_dtype": raw["dtype"]}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


class VLLMReference:
    """vLLM's offline LLM, greedy, on the same chat-templated token ids: one request at a time (batch 1), a list of
    prompts all at once, or at most c in flight through its engine loop (bench --concurrency, `generate_at`); with
    `eagle`, vLLM's EAGLE (a chain of `depth` tokens) with our head (`draft`, default <engine>/eagle). The converted
    model lives in a temporary directory for the life of this object."""

    def __init__(self, engine: str, device: str | None, dtype: str | None, max_seq_len: int | None,
                 eagle: bool = False, draft: str | None = None, depth: int = 5, max_num_seqs: int = 32,
                 prefix_cache: bool = False):
        require_vllm()
        from ..engine.loader import pick_device, read_config
        from ..llm import resolve_engine
        from ..models.tokenizer import Tokenizer

        self.engine_dir = d = resolve_engine(engine)
        self.device, dt = pick_device(device, dtype)
        if self.device.type != "cuda":
            raise UserError("vllm runs on CUDA only: pass --device cuda")
        self.method = VLLM_EAGLE if eagle else VLLM
        self.tokenizer = Tokenizer(d)
        cfg = read_config(d)
        self.eos_ids = cfg.eos_ids
        self.max_len = min(max_seq_len or cfg.max_seq_len, MAX_CACHE)
        self.tmp = tempfile.TemporaryDirectory(prefix="microspec-vllm-")
        kw = {"model": str(engine_to_hf(d, Path(self.tmp.name) / "model"))}
        if eagle:
            src = Path(draft) if draft else d / "eagle"
            if json.loads((src / "config.json").read_text()).get("eagle") == 3:  # an EAGLE-3 head: vLLM's eagle3
                method, head = "eagle3", eagle3_to_vllm(src, Path(self.tmp.name) / "eagle3")
            else:
                method, head = "eagle", eagle_to_vllm(src, d, Path(self.tmp.name) / "eagle")
            kw["speculative_config"] = {"method": method, "model": str(head), "num_speculative_tokens": depth}
        for k, v in VLLM_ENV.items():
            os.environ.setdefault(k, v)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.SamplingParams, self.TokensPrompt = SamplingParams, TokensPrompt
        self.llm = LLM(**kw, skip_tokenizer_init=True, dtype=str(dt).removeprefix("torch."), max_model_len=self.max_len,
                       gpu_memory_utilization=0.35, max_num_seqs=max_num_seqs, seed=0,
                       enable_prefix_caching=prefix_cache)

    def generate(self, prompt, max_new_tokens: int, chat: bool = True):
        """One prompt -> its Result; a list of prompts -> their Results, submitted at once (each one's wall_s is the
        whole batch's: vLLM's offline API returns them together)."""
        from ..llm import is_prompt_list

        many = is_prompt_list(prompt)
        ids = self.tokenizer.prompts_ids(prompt if many else [prompt], chat)
        if max(map(len, ids)) >= self.max_len:
            raise UserError(f"a prompt has {max(map(len, ids))} tokens; vllm's context holds {self.max_len}")
        sp = [self.SamplingParams(temperature=0.0, max_tokens=min(max_new_tokens, self.max_len - len(i)),
                                  stop_token_ids=self.eos_ids, detokenize=False) for i in ids]
        t0 = time.perf_counter()
        out = self.llm.generate([self.TokensPrompt(prompt_token_ids=i) for i in ids], sp, use_tqdm=False)
        results = [_result(self.tokenizer, list(o.outputs[0].token_ids), self.method, t0) for o in out]
        return results if many else results[0]

    def generate_at(self, prompts: list, max_new_tokens: int, concurrency: int, chat: bool = True) -> list:
        """The prompts through vLLM's own engine loop, all submitted now, at most `concurrency` in flight (the next
        one added to the engine as one finishes, as our scheduler admits its queued requests), each with the
        perf_counter time at which every step's new tokens came out of `engine.step()` (Result.emits). Its stats
        are timed like our engine's under the bench, by the same function (engine/stats.py request_times), from
        this call, where every request is submitted: TTFT and wall time count the wait for a slot too. Returns their
        Results in order."""
        from vllm.sampling_params import RequestOutputKind

        from ..engine.stats import request_times
        from ..llm import Result

        t_submit = time.perf_counter()  # every request's submission (the bench times them from its own t0 before it)
        engine = self.llm.llm_engine
        ids = self.tokenizer.prompts_ids(prompts, chat)
        if max(map(len, ids)) >= self.max_len:
            raise UserError(f"a prompt has {max(map(len, ids))} tokens; vllm's context holds {self.max_len}")
        waiting = list(range(len(ids)))[::-1]
        admitted, finished = set(), set()
        emits, tokens = {i: [] for i in range(len(ids))}, {i: [] for i in range(len(ids))}

        def admit() -> None:
            i = waiting.pop()
            sp = self.SamplingParams(temperature=0.0, max_tokens=min(max_new_tokens, self.max_len - len(ids[i])),
                                     stop_token_ids=self.eos_ids, detokenize=False,
                                     output_kind=RequestOutputKind.DELTA)
            admitted.add(i)
            engine.add_request(f"mspec-{i}", self.TokensPrompt(prompt_token_ids=ids[i]), sp)

        while waiting and len(admitted) - len(finished) < concurrency:
            admit()
        while len(finished) < len(ids):
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                i = int(o.request_id.split("-")[1])  # a version that appends its own suffix keeps the prefix
                new = list(o.outputs[0].token_ids) if o.outputs else []
                if new:
                    tokens[i] += new
                    emits[i].append((now, len(new)))
                if o.finished:
                    finished.add(i)
            while waiting and len(admitted) - len(finished) < concurrency:
                admit()
        out = []
        for i in range(len(ids)):
            t = request_times(t_submit, emits[i])
            out.append(Result(text=self.tokenizer.decode(tokens[i]), token_ids=tokens[i],
                              num_new_tokens=len(tokens[i]), emits=emits[i],
                              stats={"method": self.method, "new_tokens": len(tokens[i]), "wall_s": t["latency_s"],
                                     "ttft_s": t["ttft_s"], "inter_token_s": t["inter_token_s"]}))
        return out

    def close(self) -> None:
        """vLLM keeps its distributed state and GPU memory per process: free them before another engine starts."""
        from vllm.distributed import cleanup_dist_env_and_memory

        del self.llm
        cleanup_dist_env_and_memory()
        self.tmp.cleanup()


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UserError("vllm is not installed (pip install vllm==0.26.0 on a CUDA machine: see docs/bench.md)")
