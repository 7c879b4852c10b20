"""The EAGLE-2 round (layout: spec/tree.py) for a batch of B requests: each request drafts its own tree (one
batched draft forward per depth step), one target pass verifies every tree (B x total_tokens rows, each tree's
mask over its own KV), and acceptance is per request. The draft head goes through each request's own vocabulary
(`heads`), so MicroSpec windows stay per request. Device tensor ops only. The draft is called through
`draft.hidden(tokens, features, positions, slots, span, cache=)` alone (any head with that call fits).
"""
from __future__ import annotations

import torch

from plugins.layers import KV_BLOCK

from ..models.model import Span
from .tree import TreeConfig, Tree


def physical(table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Logical slots [B, X] of each request -> physical pool slots."""
    return table.gather(1, slots // KV_BLOCK) * KV_BLOCK + slots % KV_BLOCK


def draft_trees(draft, cache, heads, h_last, root, n, table, S: int, cfg: TreeConfig) -> Tree:
    """h_last [B, d], root [B], n [B] -> a Tree whose fields have a leading B dimension.
    heads(hidden [B, T, d], k) -> (logp [B, T, k], ids [B, T, k]), each request over its own vocabulary."""
    k, dev = cfg.top_k, h_last.device
    B, d = h_last.shape
    logp, ids = heads(h_last[:, None], k)
    logp, ids = logp[:, 0], ids[:, 0]
    pool_tok, pool_score, pool_parent = [ids], [logp], [torch.full((B, k), -1, device=dev)]
    cur_tok, cur_score, cur_idx = ids, logp, torch.arange(k, device=dev).expand(B, k)
    cur_feat = h_last[:, None].expand(B, k, d)
    eye = torch.eye(k, dtype=torch.bool, device=dev)
    anc = torch.zeros(B, k, cfg.draft_slots, dtype=torch.bool, device=dev)
    anc[:, :, :k] = eye
    offset = k
    for i in range(cfg.depth):
        slots = (n[:, None] + i * k + torch.arange(k, device=dev)).flatten()
        pos = (n + i).repeat_interleave(k)
        h = draft.hidden(cur_tok.flatten(), cur_feat.reshape(B * k, d), pos, slots,
                         Span(n, anc[:, :, : (i + 1) * k], S, table), cache=cache).view(B, k, d)
        logp, ids = heads(h, k)  # [B, k, k]
        score = (cur_score[:, :, None] + logp).flatten(1)
        pool_tok.append(ids.flatten(1))
        pool_score.append(score)
        pool_parent.append(cur_idx.repeat_interleave(k, dim=1))
        if i + 1 == cfg.depth:
            break
        best = score.topk(k, dim=1).indices
        parent_row = best // k
        cur_tok, cur_score, cur_idx = ids.flatten(1).gather(1, best), score.gather(1, best), offset + best
        cur_feat = h.gather(1, parent_row[:, :, None].expand(B, k, d))
        anc = anc.gather(1, parent_row[:, :, None].expand(B, k, anc.shape[2]))
        anc[:, :, (i + 1) * k:(i + 2) * k] |= eye
        offset += k * k
    return _select(torch.cat(pool_tok, 1), torch.cat(pool_score, 1), torch.cat(pool_parent, 1), root, cfg)


def _select(tok, score, parent, root, cfg: TreeConfig) -> Tree:
    """Per request, the best total_tokens-1 pool nodes by path score, kept in pool order (so parents precede
    children); a child never scores above its parent, and the tiny depth penalty breaks exact ties (p = 1.0 in
    fp32) so the chosen set always holds each chosen node's parent."""
    dev, N = tok.device, cfg.total_tokens
    B, P = tok.shape
    level = torch.cat([torch.zeros(cfg.top_k, device=dev)] +
                      [torch.full((cfg.top_k ** 2,), i + 1.0, device=dev) for i in range(cfg.depth)])
    chosen = (score - 1e-4 * level).topk(N - 1, dim=1).indices.sort(dim=1).values
    tree_of = torch.zeros(B, P + 1, dtype=torch.long, device=dev)  # pool index -> tree index; P: the root's sink
    tree_of.scatter_(1, chosen, torch.arange(1, N, device=dev).expand(B, N - 1))
    pp = parent.gather(1, chosen)
    par = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), tree_of.gather(1, torch.where(pp < 0, P, pp))],
                    1)
    eye = torch.eye(N, dtype=torch.bool, device=dev)
    anc = eye.expand(B, N, N)
    for _ in range(cfg.depth + 1):
        anc = eye | anc.gather(1, par[:, :, None].expand(B, N, N))
    tokens = torch.cat([root[:, None], tok.gather(1, chosen)], 1)
    return Tree(tokens=tokens, parent=par, depth=anc.sum(2) - 1, anc=anc)


def verify(target, cache, tree: Tree, n, table, S: int):
    """One target pass over every request's tree -> hidden [B, N, d], logits [B, N, V]."""
    B, N = tree.tokens.shape
    slots = n[:, None] + torch.arange(N, device=n.device)
    h = target(tree.tokens.flatten(), (n[:, None] + tree.depth).flatten(), slots.flatten(),
               Span(n, tree.anc, S, table), cache=cache)
    return h.view(B, N, -1), target.logits(h).view(B, N, -1)


def accept(tree: Tree, argmax: torch.Tensor, max_path: int):
    """Acceptance per request (greedy, or sampled with `argmax` the target's draws: spec/sampling.py): path
    [B, max_path] (tree indices by depth, padded with the leaf), accepted draft tokens k [B], emitted [B, max_path]
    (valid up to index k)."""
    B, N = tree.tokens.shape
    ok = (tree.tokens == argmax.gather(1, tree.parent)) | (tree.depth == 0)
    path_ok = ~(tree.anc & ~ok[:, None, :]).any(2)
    leaf = torch.where(path_ok, tree.depth, -1).argmax(1)  # [B]
    levels = torch.arange(max_path, device=ok.device)[None, :, None]
    leaf_anc = tree.anc.gather(1, leaf[:, None, None].expand(B, 1, N))  # [B, 1, N]
    on_path = leaf_anc & (tree.depth[:, None, :] == levels)  # [B, max_path, N]
    path = torch.where(on_path.any(2), on_path.float().argmax(2), leaf[:, None])
    return path, tree.depth.gather(1, leaf[:, None])[:, 0], argmax.gather(1, path)
