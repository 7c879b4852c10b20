"""The CUDA kernels of plugins/csrc, built with torch's extension builder on first use and registered as the
"cuda" kernels of the ops in plugins/ops.py, whose torch bodies stay the reference and the CPU path."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from . import ops

CSRC = Path(__file__).parent / "csrc"
_ext = None


def build_dir() -> Path:
    """<cache>/plugins/<torch version>-sm<arch>: a build never loads under another torch or GPU."""
    from trtllm_microspec.models.registry import cache_dir

    major, minor = torch.cuda.get_device_capability()
    return cache_dir() / "plugins" / f"torch{torch.__version__}-sm{major}{minor}"


def load(verbose: bool = False):
    """Import the extension, compiling it first if its sources or flags changed (a minute or two)."""
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load as build

        major, minor = torch.cuda.get_device_capability()
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")  # this GPU only: 9.0 on the H200
        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        _ext = build(name="microspec_plugins", sources=[str(CSRC / "bind.cpp"), str(CSRC / "ops.cu")],
                     build_directory=str(out), extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], verbose=verbose)
    return _ext


def register() -> None:
    """Make the ops run the CUDA kernels on CUDA tensors (CPU tensors keep the reference)."""
    ext = load()
    fused_rows = ext.topk_max_rows()  # the epilogue keeps a row of logits in shared memory
    fused_k = ext.topk_max_k()  # and each warp's k picks

    def unique_first_rows(ids, first, batch):
        return ext.unique_first_rows(ids, first, batch)

    def window_update_rows(ring, head, count, slot_of, id_of, first, new_ids, batch):
        return ext.window_update_rows(ring, head, count, slot_of, id_of, first, new_ids, batch)

    def gather_rows(src, ids, dst, slots):
        ext.gather_rows(src, ids, dst, slots)

    def packed_head(hidden, packed, id_of, k):
        # cuBLAS GEMM, then one fused masked log-softmax + top-k + slot->id kernel; the full and 32k heads
        # (too many rows for shared memory) keep the torch epilogue, negligible next to their GEMM
        if hidden.dim() != 2 or not 1 <= k <= min(packed.shape[0], fused_k) or packed.shape[0] > fused_rows:
            return ops.REFERENCE["packed_head"](hidden, packed, id_of, k)
        return ext.logsoftmax_topk(F.linear(hidden, packed), id_of, k)

    def masked_topk(logits, id_of, k):
        B, T, R = logits.shape
        if not 1 <= k <= min(R, fused_k) or R > fused_rows:
            return ops.REFERENCE["masked_topk"](logits, id_of, k)
        logp, ids = ext.logsoftmax_topk(logits.reshape(B * T, R), id_of, k)
        return logp.view(B, T, k), ids.view(B, T, k)

    ops.masked_topk.register_kernel("cuda")(masked_topk)
    ops.unique_first_rows.register_kernel("cuda")(unique_first_rows)
    ops.window_update_rows.register_kernel("cuda")(window_update_rows)
    ops.gather_rows.register_kernel("cuda")(gather_rows)
    ops.packed_head.register_kernel("cuda")(packed_head)
