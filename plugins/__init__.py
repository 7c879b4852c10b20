"""MicroSpec's custom ops: ops.py defines them (torch.library) with plain-torch bodies, the reference and the
CPU path; cuda.py + csrc/ hold their CUDA kernels. On a machine with a GPU, importing this package builds the
kernels on first use (build_scripts/build_plugins.py does it ahead) and registers them for CUDA tensors.
MICROSPEC_PLUGINS=torch keeps the reference everywhere (A/B runs); =cuda makes a failed build an error instead
of a warning. CPU machines and CI never need a compiler."""
from __future__ import annotations

import os
import warnings

import torch

from . import ops

MODE = os.environ.get("MICROSPEC_PLUGINS", "auto")
if MODE not in ("auto", "torch", "cuda"):
    raise ValueError(f"MICROSPEC_PLUGINS={MODE!r}: use auto, torch or cuda")

BACKEND = "torch"  # what the ops run on CUDA tensors: "cuda" once the kernels are registered
if MODE != "torch" and torch.cuda.is_available():
    from . import cuda

    try:
        cuda.register()
        BACKEND = "cuda"
    except Exception as e:  # a broken toolchain must not stop the engine: the reference is correct, only slower
        if MODE == "cuda":
            raise
        warnings.warn(f"MicroSpec CUDA kernels unavailable, the ops run the torch reference: {e}")
