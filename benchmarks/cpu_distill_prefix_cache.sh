#!/bin/bash
# CPU A/B of the prefix cache on `microspec distill`: the same 32 ShareGPT conversations (3 turns, 64 tokens an
# answer, smollm2-135m, fp32) with it on and off, twice each in turn; then the shards compared token for token.
# Run from a checkout with the package installed; OUT (default /tmp/distill_ab) gets the shards and logs.
set -euo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/distill_ab}
mkdir -p "$O"
git log --oneline -1 > "$O/commit"
for mode in prefix-cache no-prefix-cache prefix-cache no-prefix-cache; do
  rm -rf "$O/d_$mode"
  microspec distill --engine smollm2-135m --out "$O/d_$mode" --conversations 32 --turns 3 --max-tokens 64 \
    --device cpu --max-batch 16 "--$mode" > "$O/$mode.json" 2>> "$O/$mode.log"
done
O=$O python - <<'PY'
import glob
import os

import numpy as np

O = os.environ["O"]
a, b = (sorted(glob.glob(f"{O}/d_{m}/shard_*.npz")) for m in ("prefix-cache", "no-prefix-cache"))
same = len(a) == len(b) > 0 and all(np.array_equal(np.load(x)[k], np.load(y)[k]) for x, y in zip(a, b)
                                    for k in ("tokens", "assistant", "offsets", "conv"))
print("shards identical:", same)
PY
grep -h "tok/s\|engine steps" "$O"/*.log
