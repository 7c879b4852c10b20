"""The EAGLE-2 round (layout: speculative/tree.py) for a batch of B requests: each request drafts its own tree (one
batched draft forward per depth step), one target pass verifies every tree (B x total_tokens rows, each tree's
mask over its own KV), and acceptance is per request. The draft head goes through each request's own vocabulary
(`heads`), so MicroSpec windows stay per request. Device tensor ops only. The draft is called through
`draft.hidden(tokens, features, positions, slots, span, cache=)` alone (any head with that call fits).
"""
from __future__ import annotations

import functools

import torch

from plugins.layers import KV_BLOCK

from ..models.model import Span
from .tree import Tree, TreeConfig, causal


def physical(table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Logical slots [B, X] of each request -> physical pool slots."""
    return table.gather(1, slots // KV_BLOCK) * KV_BLOCK + slots % KV_BLOCK


@functools.cache
def _constants(cfg: TreeConfig, dev: torch.device) -> dict:
    """The index and mask tensors every round of this tree shape uses, made once (a CUDA graph replays them
    without a kernel each)."""
    k, depth, N = cfg.top_k, cfg.depth, cfg.total_tokens
    pool = k + depth * k * k
    anc0 = torch.zeros(k, cfg.draft_slots, dtype=torch.bool, device=dev)
    anc0[:, :k] = torch.eye(k, dtype=torch.bool, device=dev)
    # expansion i's new ancestor bits: its own k rows at draft slots (i + 1) k .. (i + 2) k
    step_eye = torch.zeros(max(depth - 1, 1), k, cfg.draft_slots, dtype=torch.bool, device=dev)
    for i in range(depth - 1):
        step_eye[i, :, (i + 1) * k:(i + 2) * k] = torch.eye(k, dtype=torch.bool, device=dev)
    level = torch.cat([torch.zeros(k, device=dev)] + [torch.full((k * k,), i + 1.0, device=dev) for i in range(depth)])
    return dict(
        anc0=anc0, step_eye=step_eye,
        first_idx=torch.arange(k, device=dev)[None],
        # the pool offset of expansion i's k inputs (i >= 1; the i-th level's top-k), element by element
        offsets=torch.tensor([k + i * k * k for i in range(depth - 1) for _ in range(k)], device=dev)[None],
        # the first level's parent: the pool's sink index (tree index 0, the root)
        root_parent=torch.full((1, k), pool, dtype=torch.long, device=dev),
        # draft-cache slot offset and position offset of every expansion step's k rows, [depth, 1, k]
        step_slots=torch.arange(depth * k, device=dev).view(depth, 1, k),
        step_pos=torch.arange(depth, device=dev).view(depth, 1, 1).expand(depth, 1, k).contiguous(),
        penalty=1e-4 * level, tree_idx=torch.arange(1, N, device=dev)[None],
        zero=torch.zeros(1, 1, dtype=torch.long, device=dev), eye_n=torch.eye(N, dtype=torch.bool, device=dev))


@functools.cache
def _arange(n: int, dev: torch.device) -> torch.Tensor:
    return torch.arange(n, device=dev)


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
        score, best, cur_tok, cur_score, cur_feat, anc = _grow(cur_score, logp, ids, h, anc, c["step_eye"][i])
        pool_tok.append(ids.flatten(1))
        pool_score.append(score)
        bests.append(best)
    tokens, parent, depth, anc = _tree(root, pool_tok, pool_score, bests, cfg, c)
    return Tree(tokens=tokens, parent=parent, depth=depth, anc=anc)


def _grow(cur_score, logp, ids, h, anc, step_eye):
    """One expansion's bookkeeping: the path scores of its k x k children [B, k * k], and of them the top-k that
    the next step expands: their pool indices, tokens, scores, parents' draft hiddens and ancestor rows (their
    parent's, plus their own bit)."""
    B, k = ids.shape[:2]
    score = (cur_score[:, :, None] + logp).flatten(1)
    best = score.topk(k, dim=1).indices
    parent_row = best // k
    feat = h.gather(1, parent_row[:, :, None].expand(B, k, h.shape[-1]))
    anc = anc.gather(1, parent_row[:, :, None].expand(B, k, anc.shape[2])) | step_eye
    return score, best, ids.flatten(1).gather(1, best), score.gather(1, best), feat, anc


def _tree(root, pool_tok, pool_score, bests, cfg: TreeConfig, c: dict):
    """The pool (every level's candidates: tokens, path scores, and each node's parent, all at once: expansion i's
    k inputs -- the first level, then each level's top-k -- are the parents of its k x k children) -> the tree
    (_select)."""
    B, k = root.shape[0], cfg.top_k
    inputs = c["first_idx"].expand(B, k)
    if bests:
        inputs = torch.cat([inputs, torch.cat(bests, 1) + c["offsets"]], 1)
    parent = torch.cat([c["root_parent"].expand(B, k), inputs[:, :, None].expand(B, inputs.shape[1], k).flatten(1)], 1)
    return _select(torch.cat(pool_tok, 1), torch.cat(pool_score, 1), parent, root, cfg, c)


def _select(tok, score, parent, root, cfg: TreeConfig, c: dict):
    """Per request, the best total_tokens-1 pool nodes by path score, kept in pool order (so parents precede
    children); a child never scores above its parent, and the tiny depth penalty breaks exact ties (p = 1.0 in
    fp32) so the chosen set always holds each chosen node's parent. parent: pool index, the first level's the
    sink P (the root). Returns the Tree's fields (tokens, parent, depth, anc)."""
    dev, N = tok.device, cfg.total_tokens
    B, P = tok.shape
    chosen = (score - c["penalty"]).topk(N - 1, dim=1).indices.sort(dim=1).values
    tree_of = torch.zeros(B, P + 1, dtype=torch.long, device=dev)  # pool index -> tree index; P: the root's sink
    tree_of.scatter_(1, chosen, c["tree_idx"].expand(B, N - 1))
    par = torch.cat([c["zero"].expand(B, 1), tree_of.gather(1, parent.gather(1, chosen))], 1)
    eye = c["eye_n"]
    anc = eye.expand(B, N, N)
    for _ in range(cfg.depth + 1):
        anc = eye | anc.gather(1, par[:, :, None].expand(B, N, N))
    tokens = torch.cat([root[:, None], tok.gather(1, chosen)], 1)
    return tokens, par, anc.sum(2) - 1, anc


def verify(target, cache, tree: Tree, n, table, S: int):
    """One target pass over every request's tree -> hidden [B, N, d], logits [B, N, V]."""
    B, N = tree.tokens.shape
    slots = n[:, None] + _arange(N, n.device)
    h = target(tree.tokens.flatten(), (n[:, None] + tree.depth).flatten(), slots.flatten(),
               Span(n, tree.anc, S, table), cache=cache)
    return h.view(B, N, -1), target.logits(h).view(B, N, -1)


def accept(tree: Tree, argmax: torch.Tensor, max_path: int):
    """Acceptance per request (greedy, or sampled with `argmax` the target's draws: speculative/sampling.py): path
    [B, max_path] (tree indices by depth, padded with the leaf), accepted draft tokens k [B], emitted [B, max_path]
    (valid up to index k)."""
    return _accept(tree.tokens, tree.parent, tree.depth, tree.anc, argmax, _arange(max_path, argmax.device))


def _accept(tokens, parent, depth, anc, argmax, levels):
    B, N = tokens.shape
    ok = (tokens == argmax.gather(1, parent)) | (depth == 0)
    path_ok = ~(anc & ~ok[:, None, :]).any(2)
    leaf = torch.where(path_ok, depth, -1).argmax(1)  # [B]
    leaf_anc = anc.gather(1, leaf[:, None, None].expand(B, 1, N))  # [B, 1, N]
    on_path = leaf_anc & (depth[:, None, :] == levels[None, :, None])  # [B, max_path, N]
    path = torch.where(on_path.any(2), on_path.float().argmax(2), leaf[:, None])
    return path, depth.gather(1, leaf[:, None])[:, 0], argmax.gather(1, path)
