"""The EAGLE-2 dynamic draft tree's shape and layout; the round itself, for a batch: speculative/batch_tree.py.

Round layout (n = committed length of both KV caches, root = the last emitted token, not yet in the target
cache; h_last = the draft hidden that predicts the token after root):
  draft:   level 1 = top-k of head(h_last); then `depth` expansion steps, each feeding the top-k nodes of the
           pool's newest level (token, parent's draft hidden) at position n+i-1 with an ancestor mask;
           finally the best total_tokens-1 nodes over all levels (+ root) form the tree.
  verify:  one target pass over the tree at positions n + depth with an ancestor mask.
  accept:  the deepest node whose whole path matches the target's argmax; emitted = the target argmax along
           that path (the matched draft tokens + the bonus token).
Shapes are static (padded to the maximum depth) so a round can be captured in a CUDA graph; the only host
read per round is the emitted tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class TreeConfig:
    depth: int = 5  # expansion steps after the first head call: depth + 1 draft forwards and head calls
    top_k: int = 10
    total_tokens: int = 60  # tree size including the root

    @property
    def max_path(self) -> int:  # root + deepest level
        return self.depth + 2

    @property
    def draft_slots(self) -> int:  # draft-cache slots the expansion steps write past the committed length
        return self.depth * self.top_k


# The tree that fits a CPU: verifying the GPU's 60-token tree costs several decode steps there (measured on a
# 2-core CPU: microspec 0.64x and eagle 0.4x AR with it), while this 12-token one breaks even with AR.
CPU_TREE = TreeConfig(depth=3, top_k=4, total_tokens=12)


def tree_for(device: torch.device | str, depth: int | None = None, top_k: int | None = None,
             total_tokens: int | None = None) -> TreeConfig:
    """The draft tree on `device`: each knob given wins, each left None takes the device's default (CPU_TREE on a
    CPU, TreeConfig() -- depth 5, top-k 10, 60 tokens -- on a GPU). Every command and LLM(...) decides here."""
    base = CPU_TREE if torch.device(device).type == "cpu" else TreeConfig()
    return TreeConfig(depth=base.depth if depth is None else depth, top_k=base.top_k if top_k is None else top_k,
                      total_tokens=base.total_tokens if total_tokens is None else total_tokens)


@dataclass
class Tree:
    """A batch of trees (speculative/batch_tree.py): every field has a leading request dimension B."""
    tokens: torch.Tensor  # [B, N] root first
    parent: torch.Tensor  # [B, N] tree index of each node's parent (root: itself)
    depth: torch.Tensor  # [B, N]
    anc: torch.Tensor  # [B, N, N] bool: anc[b, i, j] = j is i or an ancestor of i


def causal(t: int, device) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()
