#!/usr/bin/env bash
# Reproduce the GPU measurements of BENCHMARKS.md on a CUDA machine with the package installed (and the models
# fetchable, or already in MICROSPEC_CACHE). Results go to $OUT (default ./gpu_out).
#   bash benchmarks/gpu_reproduce.sh STAGE [STAGE ...]      (KEY=qwen2.5-coder-1.5b by default)
# Stages:
#   checks     the custom ops and the Triton layer kernels against their torch references (random inputs)
#   profile    per-phase time and kernel counts of a decode step, default path vs the torch reference; one layer's
#              pieces; each projection: cuBLAS vs the skinny GEMM vs the default
#   rounds     issue 22's round time at c = 1: the batched engine's step timeline at batch 1 (ROUND_CONTEXT prompt
#              tokens, 128 new) for ar, eagle and microspec with the fixed default tree (a random head: the round's
#              work does not depend on what it accepts; microspec with --trace: its kernels, and a round's pieces
#              each against its byte floor), then microspec under --spec-policy auto, whose start-up
#              prints the calibrated plain-row / 4 / 16 / 60-token step costs at 1 row (~2 min on an H200)
#   round-kernels  the round's tree selection against its torch reference, checked then timed at batch 1 / 16 / 64
#              (benchmarks/gpu_round_kernels_ab.py; seconds, no engine needed)
#   kernels-ab the skinny GEMM's configs (plain, and with the add + RMSNorm in its prologue) against the torch
#              reference at qwen2.5-coder-1.5b's shapes, then each projection (q|k|v, O, gate|up, down, EAGLE fc,
#              LM head) at rows AB_ROWS on random weights: cuBLAS vs the fastest skinny config vs the default path,
#              GB/s and % of 4.8 TB/s; the add + RMSNorm fold vs unfused, and one decoder layer with the fold off
#              vs the default (launches counted). No engine needed.
#   lossless   every method vs AR with a random head, fp32 (logic: token for token) and bf16, alone and batched
#              (the batched engine's CUDA graphs, padding rows included), every step a round (--spec-policy fixed:
#              under auto a random head is decoded plainly)
#   eagle3-lossless  the same with a random EAGLE-3 head (its own LM head over 16k random ids, d2t): ar, eagle,
#              frspec (= its own vocabulary), microspec, fp32 and bf16, alone and batched (~3 min on an H200)
#   train      train an EAGLE head for KEY into $HEAD (the recipe in <= TRAIN_LIMIT s wall: distilling, caching and
#              training), with --eval; its distilled answers are moved to $OUT/distilled_KEY
#   bench      Spec-Bench + HumanEval: AR, EAGLE, FR-Spec, MicroSpec with $HEAD, and the outside references
#   sampling   the same at temperature 0.7 (speculative sampling)
#   sweep      in-flight batching: ar, eagle, microspec at concurrency LEVELS, and vLLM at the same levels
#   fill       the paper's window (microspec-paper) vs the filled one (microspec) beside eagle and frspec, per
#              category, and both over W_max FILL_SWEEP (Fig. 6, Fig. 1b's filled line); runs build-freq if missing
#   openai     serve --openai-port: the same load through gRPC and the OpenAI endpoint at concurrency 1 and 64
#              (benchmarks/gpu_openai_overhead.sh; needs the serve extra, nvidia-pytriton and STUB_SITE)
#   serve-load the server under load beside the offline engine (issue 36): `serve --method microspec` with $HEAD,
#              the load stage's 240 first turns repeated to 1,000 at 64 and 256 over gRPC and the OpenAI endpoint, then
#              the offline engine (ar, microspec) on the same requests (benchmarks/gpu_serve_load.sh; needs the
#              serve extra, nvidia-pytriton and STUB_SITE)
#   head-ab    draft-head recipes at equal wall time (issue 28): distill KEY's own answers for DISTILL_LIMIT s
#              into $OUT/head_ab/distilled (kept: a rerun reuses it), then one train-draft per arm of ARMS, each
#              --time-limit ARM_LIMIT, scored by held-out top-1 at depths 1-5 (the same held-out distilled
#              conversations for every arm) and acceptance (eagle, default tree) on EVAL_Q questions of each
#              Spec-Bench category + HumanEval -> $OUT/head_ab/head_ab.md. Arms: sharegpt (today's data),
#              distilled, mixed (distilled + ShareGPT), sharegpt-pruned, mixed-pruned (--loss pruned),
#              mixed-pruned-ttt2, mixed-fused (--loss fused: the full loss through the Triton kernel),
#              mixed-pruned-sampled (answers sampled with SAMPLED_ARGS, distilled for DISTILL_LIMIT s too, scored on
#              the greedy arms' held-out set), and EAGLE-3 heads (issue 26): mixed-eagle3 (ttt 3),
#              mixed-eagle3-ttt5. ~17 min on an H200 with the default 3 arms. EAGLE-3 vs EAGLE-2 at equal wall
#              time: ARMS="mixed-pruned mixed-eagle3" bash benchmarks/gpu_reproduce.sh head-ab
#   recipe     the one-command head (issue 28): `train-draft --engine KEY --time-limit RECIPE_LIMIT` (900 s: a third
#              distilling, the rest caching + training on the answers + ShareGPT) into $OUT/recipe_KEY/head, then
#              --eval (eagle + microspec, default GPU tree, RECIPE_EVAL_Q questions of each Spec-Bench category +
#              HumanEval) -> $OUT/recipe_KEY/recipe.md (held-out top-1 at depths 1-5, acceptance, the stage lines).
#              ~RECIPE_LIMIT + 1.5 min on an H200; bench it after with HEAD=$OUT/recipe_KEY/head
#   smol-head  the shipped smollm2-135m head retrained by the same command (SMOL_LIMIT, 300 s) into
#              $OUT/smol_head/head (config.json + model.safetensors: the format of trtllm_microspec/drafts/
#              smollm2-135m), --eval on the GPU, then the new head beside the shipped one on the CPU in fp32 (the
#              quickstart's tree, chat prompts of its kind) -> $OUT/smol_head/smol-head.md. ~7 min on an H200
#   policy     the speculation policy (issue 22; ~6-8 min on an H200, 2 of them vLLM's two start-ups): ar, eagle
#              and microspec with the fixed default tree and with --spec-policy auto, vLLM AR and vLLM EAGLE (the
#              same head) beside, at POLICY_LEVELS on
#              the load stage's Spec-Bench first turns (POLICY_K x c of them at level c), batched runs only; the
#              acceptance and the tree sizes the policy chose per level in the table
#   load       throughput under load (~5 min on an H200): the batched engine's step timeline at batch 64/128/256,
#              then AR and vLLM on LOAD_LIMIT x 6 Spec-Bench first turns (240) at LOAD_LEVELS, batched runs only
#   overlap    the overlapped step (issue 21; ~8 min on an H200): 256 random requests in fp32 with overlap off and
#              on (outputs must be equal; tok/s of each), the AR step timeline at batch 64/128/256 with overlap off
#              and on (GPU share = the GPU's busy fraction of a step), then AR on the load stage's 240 first turns
#              at LOAD_LEVELS with --no-overlap and without, batched runs only
set -euo pipefail
export PYTHONUNBUFFERED=1    # every line as it is printed, through tee and grep too
KEY=${KEY:-qwen2.5-coder-1.5b}
OUT=${OUT:-gpu_out}
HEAD=${HEAD:-${MICROSPEC_CACHE:-$HOME/.cache/microspec}/engines/$KEY/eagle}
LIMIT=${LIMIT:-3}            # questions per Spec-Bench category
TOKENS=${TOKENS:-256}        # new tokens per turn
TRAIN_LIMIT=${TRAIN_LIMIT:-450}   # the held-out evaluation and --eval run after it: ~10 minutes in all
TRAIN_ARGS=${TRAIN_ARGS:---eval}
METHODS=${METHODS:-ar,eagle,frspec,microspec}   # frspec needs `microspec build-freq --engine KEY` first
LEVELS=${LEVELS:-1,2,4,8,16,32}  # sweep: the concurrency levels
LOAD_LEVELS=${LOAD_LEVELS:-32,64,128,256}  # load: the concurrency levels
LOAD_LIMIT=${LOAD_LIMIT:-40}  # load: first turns per Spec-Bench category (6 categories: 240 requests)
POLICY_LEVELS=${POLICY_LEVELS:-1,4,16,64,256}  # policy: the concurrency levels
POLICY_K=${POLICY_K:-2}      # policy: first turns per level, per unit of concurrency (level c decodes K x c)
POLICY_TOKENS=${POLICY_TOKENS:-128}  # policy: new tokens per request
POLICY_METHODS=${POLICY_METHODS:-ar,eagle@fixed,eagle@auto,microspec@fixed,microspec@auto,vllm,vllm-eagle}
REFS=${REFS:-hf-compiled}    # outside references: hf, hf-compiled, vllm, vllm-eagle (vLLM where installed)
FILL_SWEEP=${FILL_SWEEP:-1024}  # fill: W_max points beside the main 3072 (a comma list; empty: none)
DISTILL_LIMIT=${DISTILL_LIMIT:-170}   # head-ab: seconds of distilling (engine load included)
DISTILL_ARGS=${DISTILL_ARGS:---max-batch 256}
ARM_LIMIT=${ARM_LIMIT:-220}  # head-ab: --time-limit of each arm (tokenising and caching included; --eval after it)
ARMS=${ARMS:-sharegpt mixed mixed-pruned}
SAMPLED_ARGS=${SAMPLED_ARGS:---temperature 0.7 --top-p 0.8 --top-k 20}  # head-ab: the sampled regeneration
EVAL_Q=${EVAL_Q:-2}          # head-ab: --eval questions per category
AB_ROWS=${AB_ROWS:-1 4 16 32 60}  # kernels-ab: rows of each projection
AB_ARGS=${AB_ARGS:-}         # head-ab: more train-draft arguments for every arm (e.g. --epochs 2)
RECIPE_LIMIT=${RECIPE_LIMIT:-900}   # recipe: train-draft's --time-limit (distilling included; --eval after it)
RECIPE_EVAL_Q=${RECIPE_EVAL_Q:-3}   # recipe, smol-head: --eval questions per category
RECIPE_ARGS=${RECIPE_ARGS:-}        # recipe, smol-head: more train-draft arguments (e.g. --loss full)
SMOL_LIMIT=${SMOL_LIMIT:-300}       # smol-head: --time-limit of smollm2-135m's head
ROUND_CONTEXT=${ROUND_CONTEXT:-512}  # rounds: prompt tokens before the measured steps
mkdir -p "$OUT"
ms() { python3 -m trtllm_microspec.cli "$@"; }
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    checks)
      python3 -m plugins.check | tee "$OUT/plugins_check.txt" | tail -2
      python3 -m plugins.check_layers | tee "$OUT/check_layers.txt"
      python3 -m trtllm_microspec.train.fused_ce | tee "$OUT/fused_ce_check.txt" \
        || echo "fused_ce check FAILED (--loss fused's kernel)" ;;
    profile)
      ms profile --engine "$KEY" --out "$OUT/profile_$KEY.md" ;;
    rounds)
      for m in ar eagle microspec; do  # microspec with --trace: its kernels, and a round's pieces against their floors
        ms profile --engine "$KEY" --timeline --method $m --spec-policy fixed --batch 1 --context "$ROUND_CONTEXT" \
          --new-tokens 128 $([ $m = microspec ] && echo --trace) --out "$OUT/rounds_${m}_$KEY.md" 2>&1 \
          | grep -E "^timeline:|rror"
      done
      grep -A10 "one round's pieces" "$OUT/rounds_microspec_$KEY.md"
      ms profile --engine "$KEY" --timeline --method microspec --spec-policy auto --batch 1 \
        --context "$ROUND_CONTEXT" --new-tokens 128 --out "$OUT/rounds_microspec_auto_$KEY.md" 2>&1 \
        | grep -E "^timeline:|rror" ;;
    round-kernels)
      python3 -m plugins.check_layers --only tree_select | tail -1
      python3 benchmarks/gpu_round_kernels_ab.py | tee "$OUT/round_kernels_ab.md" ;;
    kernels-ab)
      { python3 -m plugins.check_layers --only "skinny linear" norm_linear || echo "check_layers FAILED (the A/B" \
          "still runs: a config that disagrees with the unfused path at first use is never picked)"; } \
        | tee "$OUT/check_skinny.txt"
      ms bench-kernels --layers --rows $AB_ROWS --iters 20 --out "$OUT/kernels_ab.md" ;;
    lossless)
      python3 - "$KEY" "$OUT/random_head" <<'EOF'
import sys, torch
from trtllm_microspec.llm import resolve_engine
from trtllm_microspec.models.model import ModelConfig
from trtllm_microspec.speculative.eagle import EagleDraft, draft_config, save_draft
engine = resolve_engine(sys.argv[1])
torch.manual_seed(0)  # a random head: losslessness must hold for any draft
save_draft(EagleDraft(draft_config(ModelConfig.load(engine / "config.json")), bias=False), sys.argv[2], engine)
EOF
      for dt in float32 bfloat16; do
        ms bench --engine "$KEY" --draft "$OUT/random_head" --dtype $dt --methods ar,eagle,microspec --limit 1 \
          --max-new-tokens 128 --warmup 1 --concurrency 1,4 --spec-policy fixed --out "$OUT/lossless_$dt" 2>&1 \
          | grep "mismatches"
        grep -A9 "in-flight batching" "$OUT/lossless_$dt/results.md" | tail -6
      done ;;
    eagle3-lossless)
      python3 -c "import sys; from trtllm_microspec.llm import resolve_engine; from trtllm_microspec.speculative.eagle3 import random_head
random_head(resolve_engine(sys.argv[1]), sys.argv[2], 16000)" "$KEY" "$OUT/random_eagle3"
      for dt in float32 bfloat16; do
        ms bench --engine "$KEY" --draft "$OUT/random_eagle3" --dtype $dt --methods ar,eagle,frspec,microspec --limit 1 \
          --max-new-tokens 128 --warmup 1 --concurrency 1,4 --spec-policy fixed --out "$OUT/eagle3_lossless_$dt" \
          2>&1 | grep "mismatches"
        grep -A9 "in-flight batching" "$OUT/eagle3_lossless_$dt/results.md" | tail -6
      done ;;
    train)
      ms train-draft --engine "$KEY" --out "$HEAD" --time-limit "$TRAIN_LIMIT" --save-every 0 $TRAIN_ARGS \
        2>&1 | tr '\r' '\n' | grep "\[train-draft\]\|\[distill\]\|^{\|rror" | tee "$OUT/train_$KEY.log"
      rm -rf "$OUT/distilled_$KEY"; mv "$HEAD/distilled" "$OUT/distilled_$KEY" 2>/dev/null || true ;;
    bench)
      ms bench --engine "$KEY" --draft "$HEAD" --methods "$METHODS,$REFS" --limit "$LIMIT" \
        --max-new-tokens "$TOKENS" --warmup 2 --out "$OUT/bench_$KEY" | grep "tok/s" ;;
    sampling)
      ms bench --engine "$KEY" --draft "$HEAD" --methods ar,eagle,microspec --temperature 0.7 --seed 0 --limit "$LIMIT" \
        --max-new-tokens "$TOKENS" --warmup 2 --out "$OUT/bench_${KEY}_t0.7" | grep "tok/s" ;;
    sweep)
      ms bench --engine "$KEY" --draft "$HEAD" --methods ar,eagle,microspec,vllm --concurrency "$LEVELS" \
        --limit "$LIMIT" --max-new-tokens "$TOKENS" --warmup 2 --out "$OUT/sweep_$KEY" | grep "tok/s" ;;
    fill)
      engine=$(python3 -c "from trtllm_microspec.llm import resolve_engine; print(resolve_engine('$KEY'))" | tail -1)
      [ -f "$engine/token_freq.safetensors" ] || ms build-freq --engine "$KEY"   # the fill's and frspec's ranking
      ms bench --engine "$KEY" --draft "$HEAD" --methods ar,eagle,frspec,microspec-paper,microspec --limit "$LIMIT" \
        --max-new-tokens "$TOKENS" --warmup 2 ${FILL_SWEEP:+--w-max-sweep "$FILL_SWEEP"} --out "$OUT/fill_$KEY" \
        | grep "tok/s" ;;
    openai)
      OUT="$OUT/openai_$KEY" LEVELS="1 64" bash benchmarks/gpu_openai_overhead.sh "$KEY" "$HEAD" | tail -9 ;;
    serve-load)
      OUT="$OUT/serve_load_$KEY" LIMIT="$LOAD_LIMIT" MAX_TOKENS="$TOKENS" bash benchmarks/gpu_serve_load.sh "$KEY" "$HEAD" \
        | tail -13 ;;
    head-ab)
      AB="$OUT/head_ab"; DIST="$AB/distilled"
      mkdir -p "$AB"
      if [ ! -f "$DIST/manifest.json" ]; then
        ms distill --engine "$KEY" --out "$DIST" --time-limit "$DISTILL_LIMIT" $DISTILL_ARGS 2>&1 \
          | tr '\r' '\n' | grep --line-buffered "\[distill\]\|^{\|rror" | tee "$AB/distill.log"
      fi
      SDIST="$AB/distilled_sampled"   # the sampled regeneration (arm mixed-pruned-sampled), same time
      if [[ " $ARMS " == *" mixed-pruned-sampled "* ]] && [ ! -f "$SDIST/manifest.json" ]; then
        ms distill --engine "$KEY" --out "$SDIST" --time-limit "$DISTILL_LIMIT" $DISTILL_ARGS $SAMPLED_ARGS 2>&1 \
          | tr '\r' '\n' | grep --line-buffered "\[distill\]\|^{\|rror" | tee "$AB/distill_sampled.log"
      fi
      for arm in $ARMS; do
        case $arm in
          sharegpt) args="--heldout-data $DIST --distill-time 0 --loss full --arch eagle2" ;;
          sharegpt-pruned) args="--heldout-data $DIST --distill-time 0 --loss pruned --arch eagle2" ;;
          distilled) args="--data $DIST --loss full --arch eagle2" ;;
          mixed) args="--data $DIST --mix-sharegpt --loss full --arch eagle2" ;;
          mixed-pruned) args="--data $DIST --mix-sharegpt --loss pruned --arch eagle2" ;;
          mixed-pruned-ttt2) args="--data $DIST --mix-sharegpt --loss pruned --ttt-steps 2 --arch eagle2" ;;
          mixed-eagle3) args="--data $DIST --mix-sharegpt --loss pruned --arch eagle3" ;;   # issue 26 (ttt 3)
          mixed-eagle3-ttt5) args="--data $DIST --mix-sharegpt --loss pruned --arch eagle3 --ttt-steps 5" ;;
          mixed-fused) args="--data $DIST --mix-sharegpt --loss fused --arch eagle2" ;;
          mixed-pruned-sampled) args="--data $SDIST --heldout-data $DIST --mix-sharegpt --loss pruned --arch eagle2" ;;
          *) echo "unknown head-ab arm $arm"; exit 2 ;;
        esac
        ms train-draft --engine "$KEY" --out "$AB/$arm" --time-limit "$ARM_LIMIT" --save-every 0 --eval \
          --eval-methods eagle --eval-questions "$EVAL_Q" $args $AB_ARGS 2>&1 | tr '\r' '\n' \
          | grep --line-buffered "\[train-draft\]\|^{\|rror" | tee "$AB/$arm.log" || true
        grep "^{" "$AB/$arm.log" | tail -1 > "$AB/$arm.json" || true
      done
      python3 - "$AB" $ARMS <<'EOF' | tee "$AB/head_ab.md"
import json, sys
from pathlib import Path
ab, arms = Path(sys.argv[1]), sys.argv[2:]
for name in ("distilled", "distilled_sampled"):
    if (ab / name / "manifest.json").exists():
        m = json.loads((ab / name / "manifest.json").read_text())
        print(f"{name}: {m['conversations']} conversations, {m['answers']} answers, {m['answer_tokens']:,} answer "
              f"tokens ({m['tokens']:,} in all), settings {json.dumps(m['settings'])}\n")
print("| arm | head | data | loss | ttt | train tokens | epochs | train tok/s | held-out top-1 d1..d5 | acceptance (eagle) "
      "| wall s |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for arm in arms:
    f = ab / f"{arm}.json"
    if not f.exists() or not f.read_text().strip():
        print(f"| {arm} | failed: see {arm}.log | | | | | | | | | |")
        continue
    r = json.loads(f.read_text())
    acc = " / ".join(f"{a:.3f}" for a in r["heldout_acc"])
    print(f"| {arm} | {r.get('arch', 'eagle2')} | {r['data']} | {r['loss']} | {r['ttt_steps']} | {r['train_tokens']:,} | {r['epochs']} | "
          f"{r['train_tok_per_s']:,} | {acc} | {r.get('acceptance', {}).get('eagle', '-')} | {r['wall_s']:.0f} |")
EOF
      ;;
    recipe|smol-head)
      if [ "$stage" = recipe ]; then key=$KEY; limit=$RECIPE_LIMIT; R="$OUT/recipe_$KEY"
      else key=smollm2-135m; limit=$SMOL_LIMIT; R="$OUT/smol_head"; fi
      rm -rf "$R"; mkdir -p "$R"   # a fresh run: an existing <out>/distilled would be continued, not remade
      ms train-draft --engine "$key" --out "$R/head" --time-limit "$limit" --save-every 0 --eval \
        --eval-questions "$RECIPE_EVAL_Q" $RECIPE_ARGS 2>&1 | tr '\r' '\n' \
        | grep --line-buffered "\[train-draft\]\|\[distill\]\|^{\|rror" | tee "$R/train.log" || true
      grep "^{" "$R/train.log" | tail -1 > "$R/result.json" || true
      if [ -d "$R/head/distilled" ]; then mv "$R/head/distilled" "$R/distilled"; fi   # the head dir: the shipped format
      python3 - "$R" "$key" "$limit" "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" <<'EOF' \
        | tee "$R/$stage.md"
import json, sys
from pathlib import Path
r_dir, key, limit, commit = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
text = (r_dir / "result.json").read_text().strip()
if not text:
    sys.exit(f"train-draft failed: see {r_dir / 'train.log'}")
r = json.loads(text)
d = r.get("distill", {})
print(f"`microspec train-draft --engine {key} --out HEAD --time-limit {limit} --save-every 0 --eval` at {commit}\n")
print("| target | wall to the head | distilled | train tokens (rows) | epochs | steps | train tok/s | "
      "held-out top-1 d1..d5 | acceptance eagle / microspec | wall with --eval |")
print("|---|---:|---|---|---:|---:|---:|---|---|---:|")
dist = (f"{d['run']['conversations']:,} conv, {d['run']['answer_tokens']:,} answer tok in {d['wall_s']:.0f} s"
        if d else "-")
acc = r.get("acceptance", {})
print(f"| {key} | {d.get('wall_s', 0) + r['train_s']:.0f} s | {dist} | {r['train_tokens']:,} ({r['rows']}) | "
      f"{r['epochs']} | {r['steps']} | {r['train_tok_per_s']:,} | {' / '.join(f'{a:.3f}' for a in r['heldout_acc'])} "
      f"| {acc.get('eagle', '-')} / {acc.get('microspec', '-')} | {r['wall_s']:.0f} s |")
print("\nstage lines:\n")
for line in (r_dir / "train.log").read_text().splitlines():
    if line.startswith(("[train-draft]", "[distill]")) and "%|" not in line:
        print("    " + line)
EOF
      if [ "$stage" = smol-head ]; then
        python3 - "$R/head" <<'EOF' | tee -a "$R/$stage.md"
# the new head beside the shipped one: the same files and tensors (the shipped format), and the acceptance on the
# CPU in fp32 with the CPU's tree (what the quickstart runs), greedy, chat prompts of the quickstart's kind
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
import trtllm_microspec
from trtllm_microspec.llm import LLM, resolve_engine
new = Path(sys.argv[1])
old = Path(trtllm_microspec.__file__).parent / "drafts" / "smollm2-135m"
a, b = load_file(old / "model.safetensors"), load_file(new / "model.safetensors")
same = {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
ca, cb = json.loads((old / "config.json").read_text()), json.loads((new / "config.json").read_text())
print(f"\nshipped format: files {sorted(p.name for p in new.iterdir())}, tensors equal in name/shape/dtype: {same}, "
      f"config keys differing: {sorted(k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))}, "
      f"size {(new / 'model.safetensors').stat().st_size:,} B (shipped {(old / 'model.safetensors').stat().st_size:,})")
prompts = ["Explain in a few sentences why the sky is blue.", "Write a Python function that reverses a string.",
           "What are three tips for learning a new language?", "Write a short poem about the sea.",
           "How does a hash table work?", "Summarize the plot of Romeo and Juliet in three sentences."]
torch.set_num_threads(min(8, torch.get_num_threads()))
engine = resolve_engine("smollm2-135m")
ar = LLM(engine, "ar", device="cpu", dtype="float32")
want = [ar.generate(p, 128, chat=True).token_ids for p in prompts]
print("\n| head (CPU, fp32, depth 3 / top-k 4 / 12 tokens) | acceptance microspec | acceptance eagle | identical to AR |")
print("|---|---:|---:|---|")
for name, d in (("shipped", old), ("new", new)):
    acc, same_out = {}, True
    for method in ("microspec", "eagle"):
        llm = LLM(engine, method, draft=d, device="cpu", dtype="float32", spec_policy="fixed")  # the head's rounds
        rounds = tokens = 0
        for p, w in zip(prompts, want):
            res = llm.generate(p, 128, chat=True)
            rounds, tokens = rounds + res.stats["rounds"], tokens + res.stats["round_tokens"]
            same_out = same_out and res.token_ids == w
        acc[method] = tokens / max(rounds, 1)
    print(f"| {name} | {acc['microspec']:.2f} | {acc['eagle']:.2f} | {same_out} |")
print(f"\nto ship it: cp {new}/config.json {new}/model.safetensors trtllm_microspec/drafts/smollm2-135m/ and rebuild "
      "the cached engine's copy (microspec build smollm2-135m --force)")
EOF
      fi ;;
    policy)
      # 43 first turns of each of the 6 Spec-Bench categories (258), level c decodes POLICY_K x c of them, repeated
      # past the last where there are fewer
      ms bench --engine "$KEY" --draft "$HEAD" --methods "$POLICY_METHODS" --concurrency "$POLICY_LEVELS" \
        --requests-per-level "$POLICY_K" --batched-only --limit 43 \
        --categories mt_bench,translation,summarization,qa,math_reasoning,rag --max-new-tokens "$POLICY_TOKENS" \
        --warmup 1 --out "$OUT/policy_$KEY" 2>&1 | grep -E "tok/s|rror"
      grep "^|" "$OUT/policy_$KEY/results.md" ;;  # batched-only: the one table is the in-flight batching one
    load)
      ms profile --engine "$KEY" --timeline --trace --batch 64,128,256 --context 512 --new-tokens 128 \
        --out "$OUT/timeline_$KEY.md" 2>&1 | grep -E "^timeline:|rror"
      ms bench --engine "$KEY" --methods ar,vllm --concurrency "$LOAD_LEVELS" --batched-only --limit "$LOAD_LIMIT" \
        --categories mt_bench,translation,summarization,qa,math_reasoning,rag --max-new-tokens "$TOKENS" --warmup 1 \
        --out "$OUT/load_$KEY" 2>&1 | grep -E "tok/s|rror"
      grep -A12 "in-flight batching" "$OUT/load_$KEY/results.md" | tail -9 ;;
    overlap)
      python3 benchmarks/gpu_overlap_check.py --engine "$KEY" --requests 256 --dtype float32 2>&1 | tee "$OUT/overlap_check_$KEY.txt"
      for o in off on; do
        ms profile --engine "$KEY" --timeline --batch 64,128,256 --context 512 --new-tokens 128 \
          --$([ $o = off ] && echo no-)overlap --out "$OUT/timeline_overlap_${o}_$KEY.md" 2>&1 | grep -E "^timeline:|rror"
      done
      for o in off on; do
        ms bench --engine "$KEY" --methods ar --concurrency "$LOAD_LEVELS" --batched-only --limit "$LOAD_LIMIT" \
          --categories mt_bench,translation,summarization,qa,math_reasoning,rag --max-new-tokens "$TOKENS" --warmup 1 \
          --$([ $o = off ] && echo no-)overlap --out "$OUT/load_overlap_${o}_$KEY" 2>&1 | grep -E "tok/s|rror"
        grep -A12 "in-flight batching" "$OUT/load_overlap_${o}_$KEY/results.md" | tail -9
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
