"""Counts the top-level, non-view aten ops of one decode step of an engine (torch.profiler, on the CPU), i.e. roughly
the kernels one CUDA decode step launches. The record behind docs/kernels.md's ~53 kernels a layer:
    python benchmarks/cpu_decode_opcount.py ENGINE_DIR > benchmarks/cpu_decode_opcount_qwen1.5b.txt"""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from trtllm_microspec.llm import LLM

VIEWS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::transpose",
         "aten::permute", "aten::t", "aten::slice", "aten::select", "aten::narrow", "aten::chunk", "aten::split",
         "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::as_strided", "aten::detach", "aten::alias",
         "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh", "aten::contiguous",
         "aten::resolve_conj", "aten::resolve_neg", "aten::result_type"}

llm = LLM(sys.argv[1], "ar", device="cpu", dtype="float32", max_seq_len=512)
t = llm.target
ids = torch.tensor(llm.prompt_ids("Hello there, how are you?", True))
n = len(ids)
pos = torch.arange(n)
with torch.no_grad():
    t(ids, pos, pos, pos[None, :] <= pos[:, None])  # prefill
    p = torch.tensor([n])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t.logits(t(torch.tensor([42]), p, p, (torch.arange(256) <= n)[None, :])).argmax(-1)
events = [e for e in prof.events() if e.name.startswith("aten::")]
children = {id(c) for e in events for c in e.cpu_children}
ops = collections.Counter(e.name for e in events if id(e) not in children and e.name not in VIEWS)
print(f"{sum(ops.values())} top-level non-view aten ops in one decode step of {sys.argv[1]} "
      f"({t.cfg.num_layers} layers, torch {torch.__version__})")
for name, c in ops.most_common():
    print(f"{c:6d} {name}")
