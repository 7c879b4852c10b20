"""The EAGLE-2 round (layout: speculative/tree.py) for a batch of B requests: each request drafts its own tree (one
batched draft forward per depth step), one target pass verifies every tree (B x total_tokens rows, each tree's
mask over its own KV), and acceptance is per request. The draft head goes through each request's own vocabulary
(`heads`), so MicroSpec windows stay per request. Device tensor ops only. The draft is called through
`draft.hidden(tokens, features, positions, slots, span, cache=)` alone (any head with that call fits).
"""
from __future__ import annotations

import functools

import torch

from plugins.layers import KV_BLOCK, arange_once, tree_accept, tree_grow, tree_select

from ..models.model import Span
from .tree import Tree, TreeConfig, causal


def physical(table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Logical slots [B, X] of each request -> physical pool slots."""
    return table.gather(1, slots // KV_BLOCK) * KV_BLOCK + slots % KV_BLOCK


@functools.cache
def _constants(cfg: TreeConfig, dev: torch.device) -> dict:
    """The index and mask tensors every round of this tree shape uses, made once (a CUDA graph replays them
    without a kernel each)."""
    k, depth = cfg.top_k, cfg.depth
    anc0 = torch.zeros(k, cfg.draft_slots, dtype=torch.bool, device=dev)
    anc0[:, :k] = torch.eye(k, dtype=torch.bool, device=dev)
    # expansion i's new ancestor bits: its own k rows at draft slots (i + 1) k .. (i + 2) k
    step_eye = torch.zeros(max(depth - 1, 1), k, cfg.draft_slots, dtype=torch.bool, device=dev)
    for i in range(depth - 1):
        step_eye[i, :, (i + 1) * k:(i + 2) * k] = torch.eye(k, dtype=torch.bool, device=dev)
    return dict(
        anc0=anc0, step_eye=step_eye,
        # draft-cache slot offset and position offset of every expansion step's k rows, [depth, 1, k]
        step_slots=torch.arange(depth * k, device=dev).view(depth, 1, k),
        step_pos=torch.arange(depth, device=dev).view(depth, 1, 1).expand(depth, 1, k).contiguous())


@functools.cache
def causal_mask(n: int, dev: torch.device) -> torch.Tensor:
    """causal(n), made once per size (the first round of a shape runs eagerly, before any graph capture)."""
    return causal(n, dev)


def draft_trees(draft, cache, heads, h_last, root, n, table, S: int, cfg: TreeConfig) -> Tree:
    """h_last [B, d], root [B], n [B] -> a Tree whose fields have a leading B dimension.
    heads(hidden [B, T, d], k) -> (logp [B, T, k], ids [B, T, k]), each request over its own vocabulary."""
    k, dev = cfg.top_k, h_last.device
    B, d = h_last.shape
    c = _constants(cfg, dev)
    logp, ids = heads(h_last[:, None], k)
    logp, ids = logp[:, 0], ids[:, 0]
    pool_tok, pool_score, bests = [ids], [logp], []
    cur_tok, cur_score = ids, logp
    cur_feat = h_last[:, None].expand(B, k, d)
    anc = c["anc0"].expand(B, -1, -1).contiguous()  # (contiguous: every step's _grow sees the same layout)
    # every step's draft-cache slots and positions in one op each: [depth, B, k], a step's rows contiguous; and
    # their physical slots, mapped here once for all steps
    slots_all, pos_all = n[None, :, None] + c["step_slots"], n[None, :, None] + c["step_pos"]
    phys_all = slots_all if table is None else \
        physical(table, slots_all.transpose(0, 1).reshape(B, -1)).view(B, cfg.depth, k).transpose(0, 1).contiguous()
    for i in range(cfg.depth):
        h = draft.hidden(cur_tok.flatten(), cur_feat.reshape(B * k, d), pos_all[i].flatten(), slots_all[i].flatten(),
                         Span(n, anc[:, :, : (i + 1) * k], S, table, phys=phys_all[i].flatten()),
                         cache=cache).view(B, k, d)
        logp, ids = heads(h, k)  # [B, k, k]
        if i + 1 == cfg.depth:
            pool_tok.append(ids.flatten(1))
            pool_score.append((cur_score[:, :, None] + logp).flatten(1))
            break
        score, best, cur_tok, cur_score, cur_feat, anc = tree_grow(cur_score, logp, ids, h, anc, c["step_eye"][i])
        pool_tok.append(ids.flatten(1))
        pool_score.append(score)
        bests.append(best)
    tokens, parent, depth, anc = tree_select(root, torch.cat(pool_tok, 1), torch.cat(pool_score, 1),
                                             torch.cat(bests, 1) if bests else None, k, cfg.total_tokens)
    return Tree(tokens=tokens, parent=parent, depth=depth, anc=anc)


def verify(target, cache, tree: Tree, n, table, S: int):
    """One target pass over every request's tree -> hidden [B, N, d], logits [B, N, V]."""
    B, N = tree.tokens.shape
    slots = n[:, None] + arange_once(N, n.device)
    h = target(tree.tokens.flatten(), (n[:, None] + tree.depth).flatten(), slots.flatten(),
               Span(n, tree.anc, S, table), cache=cache)
    return h.view(B, N, -1), target.logits(h).view(B, N, -1)


def accept(tree: Tree, argmax: torch.Tensor, max_path: int):
    """Acceptance per request (greedy, or sampled with `argmax` the target's draws: speculative/sampling.py): path
    [B, max_path] (tree indices by depth, padded with the leaf), accepted draft tokens k [B], emitted [B, max_path]
    (valid up to index k)."""
    return tree_accept(tree.tokens, tree.parent, tree.depth, tree.anc, argmax, max_path)
