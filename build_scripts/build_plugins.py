"""Prebuild MicroSpec's CUDA kernels (plugins/csrc) on the GPU machine, so that no run compiles on first use:
    python build_scripts/build_plugins.py
The build lands in <cache>/plugins/<torch>-sm<arch>; CPU machines need none of this."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
os.environ["MICROSPEC_PLUGINS"] = "torch"  # importing plugins must not start a quiet build of its own

import torch  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("build_plugins: no CUDA device here; CPU machines run the torch reference and need no build")
        return 2
    from plugins import cuda

    t = time.perf_counter()
    try:
        ext = cuda.load(verbose=True)
    except Exception as e:
        print(f"build_plugins: FAILED after {time.perf_counter() - t:.0f} s: {e}", file=sys.stderr)
        return 1
    print(f"build_plugins: built {ext.__file__} in {time.perf_counter() - t:.0f} s "
          f"(TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}, {torch.cuda.get_device_name()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
