"""EAGLE-2 dynamic draft tree, tree verification and greedy acceptance -- all tensor ops on the device.

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

from ..models.model import Span
from .sampling import tempered


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
    tokens: torch.Tensor  # [N] root first
    parent: torch.Tensor  # [N] tree index of each node's parent (root: itself)
    depth: torch.Tensor  # [N]
    anc: torch.Tensor  # [N, N] bool: anc[i, j] = j is i or an ancestor of i


def causal(t: int, device) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def draft_tree(draft, vocab, h_last: torch.Tensor, root: torch.Tensor, n: torch.Tensor, S: int,
               cfg: TreeConfig, temperature: torch.Tensor | None = None) -> Tree:
    """temperature (a device tensor [1], when sampling) divides the draft's logits (= its hidden, as the head is
    linear): path scores then estimate the chance that sampling accepts a path."""
    k, dev = cfg.top_k, h_last.device

    def head(h):
        return vocab.head(tempered(draft.head_in(h), temperature), k)

    logp, ids = head(h_last[None])
    pool_tok, pool_score, pool_parent = [ids[0]], [logp[0]], [torch.full((k,), -1, device=dev)]
    cur_tok, cur_score, cur_idx = ids[0], logp[0], torch.arange(k, device=dev)
    cur_feat = h_last[None].expand(k, -1)
    # ancestry among the tree's draft-cache slots. Writes below are slice ops with device tensors: assigning a
    # Python scalar through an index would copy it from the host, which a CUDA graph capture refuses
    eye = torch.eye(k, dtype=torch.bool, device=dev)
    anc = torch.zeros(k, cfg.draft_slots, dtype=torch.bool, device=dev)
    anc[:, :k] = eye
    offset = k
    for i in range(cfg.depth):
        slots = n + i * k + torch.arange(k, device=dev)
        pos = (n + i).expand(k)
        h = draft(cur_tok, cur_feat, pos, slots, Span(n, anc[:, : (i + 1) * k], S))
        logp, ids = head(h)  # [k, k]
        score = (cur_score[:, None] + logp).flatten()
        pool_tok.append(ids.flatten())
        pool_score.append(score)
        pool_parent.append(cur_idx.repeat_interleave(k))
        if i + 1 == cfg.depth:
            break
        best = score.topk(k).indices
        parent_row = best // k
        cur_tok, cur_score, cur_idx = ids.flatten()[best], score[best], offset + best
        cur_feat = h[parent_row]
        anc = anc[parent_row]
        anc[:, (i + 1) * k:(i + 2) * k] |= eye
        offset += k * k
    return _select(torch.cat(pool_tok), torch.cat(pool_score), torch.cat(pool_parent), root, cfg)


def _select(tok, score, parent, root, cfg: TreeConfig) -> Tree:
    """Best total_tokens-1 pool nodes by path score, kept in pool order (so parents precede children)."""
    dev, N = tok.device, cfg.total_tokens
    level = torch.cat([torch.zeros(cfg.top_k, device=dev)] +
                      [torch.full((cfg.top_k ** 2,), i + 1.0, device=dev) for i in range(cfg.depth)])
    # a child never scores above its parent; the tiny depth penalty breaks exact ties (p = 1.0 in fp32) so
    # the chosen set always contains each chosen node's parent
    chosen = (score - 1e-4 * level).topk(N - 1).indices.sort().values
    tree_of = torch.full((tok.numel() + 1,), 0, dtype=torch.long, device=dev)  # pool index -> tree index
    tree_of[chosen] = torch.arange(1, N, device=dev)
    par = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), tree_of[parent[chosen]]])  # -1 -> sink -> 0
    eye = torch.eye(N, dtype=torch.bool, device=dev)
    anc = eye.clone()
    for _ in range(cfg.depth + 1):
        anc = eye | anc[par]
    tokens = torch.cat([root.view(1), tok[chosen]])
    return Tree(tokens=tokens, parent=par, depth=anc.sum(1) - 1, anc=anc)


def verify(target, tree: Tree, n: torch.Tensor, S: int):
    """One target pass over the tree. Returns the final hidden states [N, d] and the logits [N, V]."""
    N, dev = tree.tokens.numel(), tree.tokens.device
    h = target(tree.tokens, n + tree.depth, n + torch.arange(N, device=dev), Span(n, tree.anc, S))
    return h, target.logits(h)


def accept(tree: Tree, argmax: torch.Tensor, max_path: int):
    """Greedy acceptance. Returns path [max_path] (tree indices by depth, padded with the leaf), the number of
    accepted draft tokens k (0-d tensor), and emitted [max_path] (valid up to index k)."""
    ok = (tree.tokens == argmax[tree.parent]) | (tree.depth == 0)  # the root is always on the path
    path_ok = ~(tree.anc & ~ok[None, :]).any(1)
    # 0-d device tensors are used through index_select: indexing with them would read them on the host
    leaf = torch.where(path_ok, tree.depth, -1).argmax().view(1)
    levels = torch.arange(max_path, device=ok.device)[:, None]
    on_path = tree.anc.index_select(0, leaf) & (tree.depth[None, :] == levels)
    path = torch.where(on_path.any(1), on_path.float().argmax(1), leaf)
    return path, tree.depth.index_select(0, leaf)[0], argmax[path]
