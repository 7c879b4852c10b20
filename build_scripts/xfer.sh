#!/usr/bin/env bash
# Move a big file (a GGUF model, a data wheel) to the GPU machine, whose `run` call carries at most 64 MiB:
#   here:   build_scripts/xfer.sh split FILE          -> .xfer/NAME.partNN (<= 54 MiB each: the tracked tree, ~9 MB, travels with every piece) + .xfer/NAME.sha256
#   device: one call per piece, carrying it:   cat .xfer/NAME.partNN >> /root/stash/NAME
#   device: build_scripts/xfer.sh check NAME   -> compares /root/stash/NAME with the recorded sha256
# Files written under /root survive between calls while the machine stays warm (30 s after a call).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  split)
    f=$2; name=$(basename "$f"); mkdir -p .xfer
    rm -f .xfer/"$name".part*
    split -b 54M -d -a 2 "$f" .xfer/"$name".part
    sha256sum "$f" | cut -d' ' -f1 > .xfer/"$name".sha256
    ls .xfer/"$name".part* ;;
  check)
    name=$2; want=$(cat .xfer/"$name".sha256); got=$(sha256sum /root/stash/"$name" | cut -d' ' -f1)
    [ "$want" = "$got" ] && echo "ok $name" || { echo "sha256 mismatch for $name: $got != $want"; exit 1; } ;;
  *) echo "usage: $0 split FILE | check NAME"; exit 2 ;;
esac
