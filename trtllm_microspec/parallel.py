"""Tensor parallelism: the process group, this rank's place in it, the collectives the model calls, and the
shard rules used when an engine is loaded.

Every rank runs the same engine steps on the same inputs (SPMD, as TensorRT-LLM does); only the target's
weights are split: q heads, k/v heads (replicated when there are fewer KV heads than ranks), gate|up columns
and the vocabulary rows of the embedding and LM head. O and down are row-parallel and end in one all-reduce
each. The EAGLE draft and the MicroSpec window are replicated, so they stay identical on every rank. At world
size 1 (the default, no process group) the model never calls in here.

Launch with `mpirun -n N microspec generate --tp N ...`: mpi4py gives the rank and size, rank 0 opens a TCP store
on localhost and sends its port to the others over MPI, and torch.distributed runs NCCL on CUDA, gloo on the CPU.
"""
from __future__ import annotations

import datetime
from dataclasses import replace

import torch
import torch.distributed as dist

from plugins import layers

from .models.registry import UserError

DEFAULT_TIMEOUT_S = 300  # a rank that stops answering ends the others' collectives with an error after this
_rank, _world = 0, 1


def rank() -> int:
    return _rank


def world() -> int:
    return _world


def init(tp: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S, rank_port: tuple | None = None):
    """Join the tensor-parallel group of `tp` ranks. rank_port = (rank, port of a TCP store the launcher hosts) for
    processes mpirun did not start (`microspec serve --tp`: the Triton model and its followers); else mpi4py says
    the rank and rank 0 hosts the store and sends its port. Returns this rank's device: cuda:rank on CUDA (one
    GPU per rank), the CPU otherwise."""
    global _rank, _world
    if _world > 1:  # already joined (an API user building a second LLM)
        if tp != _world:
            raise UserError(f"this process already runs with --tp {_world}, not {tp}")
        return _device(device)
    if rank_port is None:
        try:
            from mpi4py import MPI
        except ImportError:
            raise UserError("--tp needs mpi4py and mpirun: pip install -e '.[tp]'") from None
        comm = MPI.COMM_WORLD
        if comm.size != tp:
            raise UserError(f"--tp {tp} needs {tp} ranks, this job has {comm.size}: mpirun -n {tp} microspec ...")
        r = comm.rank
        store = dist.TCPStore("127.0.0.1", 0, tp, True, wait_for_workers=False) if r == 0 else None
        port = comm.bcast(store.port if store else None, root=0)
    else:
        (r, port), store = rank_port, None
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, tp, False, timeout=timeout)
    _rank, _world = r, tp
    dev = _device(device)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=r, world_size=tp,
                            timeout=timeout, device_id=dev if dev.type == "cuda" else None)
    return dev


def _device(device: torch.device) -> torch.device:
    if device.type != "cuda":
        return device
    if torch.cuda.device_count() < _world:
        raise UserError(f"--tp {_world} needs {_world} GPUs, this machine has {torch.cuda.device_count()}")
    torch.cuda.set_device(_rank)
    return torch.device("cuda", _rank)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, in place (row-parallel O and down, the vocabulary-split embedding)."""
    dist.all_reduce(x)
    return x


def agree(value: int, device: torch.device, op: str = "first") -> int:
    """One integer the same on every rank: rank 0's ("first": a decision that rests on its own timings, such as
    the speculation policy's), or the smallest ("min": a KV pool sized from each GPU's free memory)."""
    if _world == 1:
        return value
    x = torch.tensor([value], dtype=torch.long, device=device)
    if op == "min":
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
    else:
        dist.broadcast(x, src=0)
    return int(x.item())


def _gather(x: torch.Tensor) -> torch.Tensor:
    """[T, ...] from every rank -> [world, T, ...]."""
    out = x.new_empty((_world * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous())
    return out.view(_world, *x.shape)


def topk(logits: torch.Tensor, k: int, start: int) -> torch.Tensor:
    """The global ids [T, k] of the k largest of logits split by vocabulary, largest first: each rank's local
    top-k (value, id) pairs, gathered ([world, T, k], never the [T, V] logits), then the top-k of those."""
    v, i = layers.vocab_topk(logits, k)
    v, i = _gather(v), _gather(i + start)
    T = logits.shape[0]
    v, i = v.permute(1, 0, 2).reshape(T, -1), i.permute(1, 0, 2).reshape(T, -1)
    return i.gather(-1, v.topk(k, -1).indices)


def argmax(logits: torch.Tensor, start: int) -> torch.Tensor:
    """The global id of each row's largest logit [T]; ties go to the lowest id, as torch.argmax does."""
    v, i = logits.max(-1)
    v, i = _gather(v), _gather(i + start)  # [world, T]
    return i.gather(0, v.argmax(0, keepdim=True))[0]  # argmax: the first (lowest rank's) maximum


def vocab_range(vocab_size: int) -> tuple[int, int]:
    """The embedding / LM-head rows this rank holds."""
    return _rank * vocab_size // _world, (_rank + 1) * vocab_size // _world


def shard_config(cfg):
    """The shapes one rank holds: its q heads, k/v heads and MLP columns (the vocabulary stays whole in the
    config; `vocab_range` gives the rows). Refuses, in one line, a model whose heads do not split evenly."""
    tp, h, kv = _world, cfg.num_heads, cfg.num_kv_heads
    if h % tp or cfg.intermediate_size % tp or (kv % tp if kv >= tp else tp % kv):
        raise UserError(f"--tp {tp} does not split this model: {h} heads, {kv} KV heads and an MLP of "
                        f"{cfg.intermediate_size} must each divide by {tp} (KV heads: or divide {tp})")
    return replace(cfg, num_heads=h // tp, num_kv_heads=max(kv // tp, 1), intermediate_size=cfg.intermediate_size // tp)


def shard_state_dict(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """This rank's slice of every weight of a full engine state dict (Hugging Face names; q/k/v and gate/up are
    still separate there, so each part is cut on its own before the fused GEMM's load hook joins them)."""
    r, tp, d = _rank, _world, cfg.head_dim
    kv = cfg.num_kv_heads
    lo, hi = vocab_range(cfg.vocab_size)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, 0)[r]

    def kv_rows(t: torch.Tensor) -> torch.Tensor:
        if kv >= tp:
            return rows(t)
        j = r // (tp // kv)  # the KV head this rank's q heads read (replicated over tp // kv ranks)
        return t[j * d:(j + 1) * d]

    out = {}
    for name, t in sd.items():
        part = name.rsplit(".", 2)[-2]  # q_proj, o_proj, embed_tokens, ...
        if part in ("q_proj", "gate_proj", "up_proj"):
            t = rows(t)
        elif part in ("k_proj", "v_proj"):
            t = kv_rows(t)
        elif part in ("o_proj", "down_proj"):
            t = t.chunk(tp, 1)[r]
        elif part in ("embed_tokens", "lm_head"):
            t = t[lo:hi]
        out[name] = t.contiguous()
    return out
