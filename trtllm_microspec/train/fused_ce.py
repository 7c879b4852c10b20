"""`train-draft --loss fused`: the soft cross-entropy of the draft's distribution against the target's over the whole
vocabulary -- the exact loss of `--loss full` -- with the softmax part in one Triton kernel.

Why: `--loss full` (train_draft.SoftCE) makes both logits a chunk of rows at a time with cuBLAS, then casts them to
fp32 and runs the softmax, the cross-entropy and the gradient as separate passes over [rows, V] fp32 tensors: ~34
bytes of memory traffic per logit against ~2 x D FLOPs, which at V = 152k made the loss most of a training step.
Here one GEMM makes both chunks' logits in the weight's dtype ([2 rows, V]: the draft's rows, then the target's),
and the kernel reads each logit row twice -- pass 1: the online log-sum-exp of both distributions, the
target-weighted sum of the draft's logits and both argmaxes; pass 2: the gradient softmax(zq) - softmax(zt) written
over the draft's logits in place -- so no fp32 [rows, V] tensor exists and the traffic is ~16 bytes per logit.
The gradient GEMM then reads it in place. The logits are the same bf16-rounded values the torch path computes
(cuBLAS's output dtype), the arithmetic is fp32, so the loss and gradient equal the plain ones to rounding.

Reference: `soft_ce_reference` (plain torch, one [rows, V] tensor); `python -m trtllm_microspec.train.fused_ce`
checks the two on random inputs, the real shapes of qwen2.5-coder-1.5b included on a GPU (TRITON_INTERPRET=1 runs
it on a CPU, on small shapes; the test suite does).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from .train_draft import SoftCE  # the contract and backward this kernel's forward serves

try:
    import triton
    import triton.language as tl
except ImportError:  # the package runs without Triton on a CPU; --loss fused then refuses to start
    triton = None

CHUNK = 1 << 26  # logits (of each distribution) per chunk: [rows, V] bf16 x 2 is 256 MB at most
BLOCK = 1024  # vocabulary ids a kernel step reads


def soft_ce_reference(h: torch.Tensor, weight: torch.Tensor, want: torch.Tensor):
    """Plain torch: (sum over rows of -sum_v softmax(want W^T) log softmax(h W^T), rows whose argmaxes agree)."""
    zq, zt = F.linear(h.to(weight.dtype), weight).float(), F.linear(want.to(weight.dtype), weight).float()
    return -(zt.softmax(-1) * zq.log_softmax(-1)).sum(), (zq.argmax(-1) == zt.argmax(-1)).sum()


if triton is not None:
    @triton.jit
    def _soft_ce_rows(z_ptr, loss_ptr, agree_ptr, rows, V, stride, BLOCK: tl.constexpr):
        """Row r of the draft's logits z[r] and the target's z[rows + r]: loss[r] = lse(zq) - sum_v p_t zq, agree[r]
        = (argmax zq == argmax zt, first index on ties as torch's), then z[r] := softmax(zq) - softmax(zt)."""
        r = tl.program_id(0)
        q_row = z_ptr + r.to(tl.int64) * stride
        t_row = z_ptr + (r + rows).to(tl.int64) * stride
        mq = tl.full([], float("-inf"), tl.float32)
        mt = tl.full([], float("-inf"), tl.float32)
        sq = tl.zeros([], tl.float32)
        st = tl.zeros([], tl.float32)
        a = tl.zeros([], tl.float32)  # sum_v exp(zt - mt) * zq, rescaled with mt
        iq = tl.zeros([], tl.int32)
        it = tl.zeros([], tl.int32)
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            ok = cols < V
            q = tl.load(q_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            bq = tl.max(q, 0)
            iq = tl.where(bq > mq, off + tl.argmax(q, 0), iq)  # strict: an earlier block keeps a tie
            nq = tl.maximum(mq, bq)
            sq = sq * tl.exp(mq - nq) + tl.sum(tl.exp(q - nq), 0)
            mq = nq
            bt = tl.max(t, 0)
            it = tl.where(bt > mt, off + tl.argmax(t, 0), it)
            nt = tl.maximum(mt, bt)
            scale = tl.exp(mt - nt)
            et = tl.exp(t - nt)
            st = st * scale + tl.sum(et, 0)
            a = a * scale + tl.sum(et * tl.where(ok, q, 0.0), 0)
            mt = nt
        lq = mq + tl.log(sq)
        lt = mt + tl.log(st)
        tl.store(loss_ptr + r, lq - a / st)
        tl.store(agree_ptr + r, (iq == it).to(tl.int32))
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            ok = cols < V
            q = tl.load(q_row + cols, mask=ok, other=0.0).to(tl.float32)
            t = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32)
            d = tl.exp(q - lq) - tl.exp(t - lt)
            tl.store(q_row + cols, d.to(z_ptr.dtype.element_ty), mask=ok)


def available(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


class FusedSoftCE(SoftCE):
    """SoftCE's contract and backward (train_draft): (sum of the soft CE over rows, rows whose argmaxes agree), the
    input gradient computed in the forward a chunk of rows at a time; here the softmax part is `_soft_ce_rows`."""

    @staticmethod
    def forward(ctx, h, weight, want):
        V = weight.shape[0]
        rows = max(1, CHUNK // V)
        loss = torch.zeros((), device=h.device)
        correct = torch.zeros((), dtype=torch.long, device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        for i in range(0, h.shape[0], rows):
            n = min(rows, h.shape[0] - i)
            z = F.linear(torch.cat([h[i:i + n], want[i:i + n]]).to(weight.dtype), weight)  # [2n, V]
            part = torch.empty(n, dtype=torch.float32, device=h.device)
            agree = torch.empty(n, dtype=torch.int32, device=h.device)
            _soft_ce_rows[(n,)](z, part, agree, n, V, z.stride(0), BLOCK=BLOCK, num_warps=8)
            loss, correct = loss + part.sum(), correct + agree.sum()
            if grad is not None:
                grad[i:i + n] = (z[:n] @ weight).to(h.dtype)  # z[:n] holds the gradient now
        ctx.save_for_backward(grad, None)  # no weight gradient: EAGLE-1/2's head is the target's, frozen
        ctx.mark_non_differentiable(correct)
        return loss, correct


def check(device: str, shapes) -> int:
    """Fused vs reference on random inputs: loss and input gradient (relative error), agreeing rows; returns the
    failures."""
    g = torch.Generator().manual_seed(0)
    fails = 0
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for N, D, V in shapes:
            w = (torch.randn(V, D, generator=g) * D ** -0.5 * 4).to(device, dtype)
            h0 = torch.randn(N, D, generator=g).to(device, dtype)
            want = (h0.float() + 0.3 * torch.randn(N, D, generator=g).to(device)).to(dtype)  # argmaxes often agree
            h = h0.clone().requires_grad_(True)
            global CHUNK
            CHUNK, full = (3 * V if V < 10_000 else CHUNK), CHUNK  # small shapes: chunks of 3 rows
            try:
                loss, correct = FusedSoftCE.apply(h, w, want)
            finally:
                CHUNK = full
            (3 * loss).backward()
            ref_h = h0.clone().requires_grad_(True)
            ref, ref_correct = soft_ce_reference(ref_h, w, want)
            (3 * ref).backward()
            err_l = abs(float(loss.detach()) - float(ref.detach())) / abs(float(ref.detach()))
            err_g = float((h.grad.double() - ref_h.grad.double()).norm() / ref_h.grad.double().norm())
            # bf16 logits tie often (8 mantissa bits) and cuBLAS may round a row differently at another row count
            slack = 0 if dtype == torch.float32 else max(1, N // 100)
            ok = err_l < tol and err_g < tol and abs(int(correct) - int(ref_correct)) <= slack
            fails += not ok
            print(f"{'PASS' if ok else 'FAIL'} fused soft CE N={N} D={D} V={V} {str(dtype)[6:]}: loss {err_l:.1e}, "
                  f"grad {err_g:.1e}, agreeing rows {int(correct)} / {int(ref_correct)}")
    return fails


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        from plugins.check_layers import fix_interpreter
        fix_interpreter()  # (a loop bound passed as an argument, under Triton 3.6's interpreter and numpy >= 2.4)
    shapes = [(7, 32, 500), (5, 48, 2100), (3, 16, 1024)]  # V not a BLOCK multiple, several blocks, exactly one
    if a.device == "cuda":
        shapes += [(4096, 1536, 151936), (3000, 1536, 32768)]  # qwen2.5-coder-1.5b: full and pruned vocabularies
    fails = check(a.device, shapes)
    print(f"{'all' if not fails else fails} {'passed' if not fails else 'FAILED'}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
