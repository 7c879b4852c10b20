"""CPU A/B of the draft vocabularies (issue 23): eagle (full), frspec-32k, the paper's window, the filled window
(FR-Spec ranking, and the token-id-order fallback) and both at K_ver 8; issue 37: K_ver 16 / 32 and the target's
top-K at every tree node (k_tree 1 / 3 / 8; a label without k_tree= runs k_tree 0), on SmolLM2-135M with its packaged head,
fp32, the quickstart's CPU tree, six chat prompts of the quickstart's kind, 128 new tokens; checks every output
against AR's. RANKED: an engine dir with `microspec build-freq` run in it (a copy whose files link to the
cached engine keeps the cache as it is); PLAIN: one without token_freq.safetensors.
    [RUNS="label,label"] python benchmarks/cpu_fill_ab.py RANKED PLAIN [OUT.json]
Every step is a round of the tree (spec_policy fixed), so the numbers are the window's, not the speculation
policy's."""
import json, os, sys
from trtllm_microspec import LLM
PROMPTS = {
 "explain": "Explain in a few sentences why the sky is blue.",
 "story": "Write a short story about a robot who learns to paint.",
 "translation": "Translate into French: The weather is lovely today and we are going to the beach with our friends.",
 "math": "A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep does he have? Explain step by step.",
 "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
 "summary": "Summarize in two sentences: The Industrial Revolution began in Britain in the late 18th century. It brought steam engines, factories and railways, moved people from farms to cities, and changed how goods were made and traded across the world.",
}
RANKED, PLAIN = sys.argv[1], sys.argv[2]
N = 128
# every step a round of this tree (spec_policy fixed): the window's effect alone, not the speculation policy's
TREE = dict(depth=3, top_k=4, total_tokens=12, spec_policy="fixed")
RUNS = [("eagle", RANKED, {}), ("frspec-32k", RANKED, {"method": "frspec"}),
        ("microspec-paper", RANKED, {}), ("microspec", RANKED, {}),
        ("microspec (id-order fill)", PLAIN, {"method": "microspec"}),
        ("microspec-paper k_ver=8", RANKED, {"method": "microspec-paper", "k_ver": 8}),
        ("microspec k_ver=8", RANKED, {"method": "microspec", "k_ver": 8}),
        ("microspec k_ver=16", RANKED, {"method": "microspec", "k_ver": 16}),
        ("microspec k_ver=32", RANKED, {"method": "microspec", "k_ver": 32}),
        ("microspec k_tree=1", RANKED, {"method": "microspec", "k_tree": 1}),
        ("microspec k_tree=3", RANKED, {"method": "microspec", "k_tree": 3}),
        ("microspec k_tree=8", RANKED, {"method": "microspec", "k_tree": 8})]
ONLY = os.environ.get("RUNS")  # a comma-separated subset of the labels (default: all)
if ONLY:  # in the order given
    RUNS = [next(r for r in RUNS if r[0] == label) for label in ONLY.split(",")]
ar = LLM(RANKED, "ar", device="cpu")
want = {k: ar.generate(p, N, chat=True).token_ids for k, p in PROMPTS.items()}
del ar
out = {}
for label, eng, kw in RUNS:
    kw = dict(kw); method = kw.pop("method", label)
    kw.setdefault("k_tree", 0)  # every label without k_tree=: the window before issue 37 (now default 3)
    llm = LLM(eng, method, device="cpu", **TREE, **kw)
    rows = {}
    for k, p in PROMPTS.items():
        r = llm.generate(p, N, chat=True)
        s = r.stats
        rows[k] = dict(same=r.token_ids == want[k], acc=s["acceptance_length"], vocab=s["vocab_mean"],
                       cov=s["coverage"], new=s["new_tokens"], rounds=s["rounds"], tps=s["tokens_per_s"],
                       covered=s["covered"], round_tokens=s["round_tokens"], wall=s["wall_s"])
    out[label] = rows
    emitted = sum(r["round_tokens"] for r in rows.values())  # the rounds' tokens, over which coverage is counted
    cov = sum(r["covered"] for r in rows.values()) / emitted
    acc = emitted / sum(r["rounds"] for r in rows.values())
    tps = sum(r["new"] for r in rows.values()) / sum(r["wall"] for r in rows.values())
    print(f"{label}: coverage {cov:.1%} acceptance {acc:.3f} tokens/s {tps:.1f} vocab_mean "
          f"{sum(r['vocab'] for r in rows.values())/len(rows):.0f} lossless {all(r['same'] for r in rows.values())} | " +
          " ".join(f"{k} {r['cov']:.0%}/{r['acc']:.2f}" for k, r in rows.items()), flush=True)
if len(sys.argv) > 3:
    json.dump(out, open(sys.argv[3], "w"), indent=1)
