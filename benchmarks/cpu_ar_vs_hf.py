"""CPU A/B in one process: our AR, MicroSpec (optionally with a smaller tree: DEPTH TREE_TOP_K TOTAL_TOKENS) and
transformers' eager generate on SmolLM2-135M, fp32, 2 threads, one chat prompt, 64 new tokens, two rounds each.
    python benchmarks/cpu_ar_vs_hf.py [DEPTH TREE_TOP_K TOTAL_TOKENS]
Prints (new tokens, tokens/s, acceptance length) per round."""
import time, torch, sys
torch.set_num_threads(2)
from trtllm_microspec.llm import LLM
from trtllm_microspec.bench.references import HFReference
ours = LLM("smollm2-135m", method="ar", device="cpu")
spec = LLM("smollm2-135m", method="microspec", device="cpu", **({"depth": int(sys.argv[1]), "top_k": int(sys.argv[2]), "total_tokens": int(sys.argv[3])} if len(sys.argv) > 3 else {}))
hf = HFReference("smollm2-135m", "cpu", None)
p = [{"role": "user", "content": "Explain how a hash map works."}]
for m in (ours, spec, hf): m.generate(p, 8, chat=True)
res = {"ours": [], "spec": [], "hf": []}
for i in range(2):
    for name, m in (("ours", ours), ("spec", spec), ("hf", hf)):
        t0 = time.perf_counter(); r = m.generate(p, 64, chat=True); dt = time.perf_counter() - t0
        res[name].append((r.num_new_tokens, round(r.num_new_tokens / dt, 2), round(r.stats.get("acceptance_length", 0) or 0, 2)))
for k, v in res.items(): print(k, v)
