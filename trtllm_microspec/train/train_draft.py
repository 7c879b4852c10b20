"""`microspec train-draft`: train an EAGLE-1/2 draft head for an engine on ShareGPT conversations.

Recipe (EAGLE's): the draft is fc + one decoder layer; the target's embedding and LM head are frozen and shared.
Input at position i = (embedding of token i+1, target feature i) -> predicted feature i+1, where features are
the target's final-normed hidden states. Loss = smooth-L1(predicted, target feature i+1)
+ 0.1 x cross-entropy of head(predicted) against the soft target distribution softmax(head(feature i+1)),
over the positions whose input token i+1 belongs to an assistant turn (that is where the draft drafts at
inference). The input features get uniform noise, as EAGLE's training does, so the draft tolerates its own
imprecise features at deeper tree levels.

Data: conversations rendered with the target's chat template (the assistant turns are ChatGPT's, as in EAGLE),
truncated to --max-len tokens, packed several to a sequence of --max-len tokens with a block-diagonal causal
mask and per-conversation positions (the model code runs one sequence per forward). The target runs once per
packed sequence; its features are cached on the device, and the target distribution is recomputed from them
through the head at each step (V floats per token would not fit).
The last --heldout fraction of the conversations is held out; its loss and top-1 accuracy (draft argmax ==
target argmax for the next token) are reported before and after training. A checkpoint (fp32 weights +
optimizer) is written to <out>/checkpoint.pt every --save-every steps; --resume continues from it, and the data
order depends only on --seed and the step, so a resumed run follows the uninterrupted one. --time-limit
cuts training short (the LR schedule stays planned for the full run; rerun with --resume to finish it).
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..models.model import KVCache, Transformer
from ..models.registry import UserError
from ..models.tokenizer import Tokenizer
from ..spec.eagle import EagleDraft, draft_config, save_draft

CE_WEIGHT = 0.1  # EAGLE's weight of the token loss against the feature loss
NOISE = 0.1  # EAGLE's uniform noise on the input features: U(-NOISE, NOISE)
CHECKPOINT = "checkpoint.pt"


@dataclass
class Pack:
    """One packed training sequence and its draft pairs."""
    tokens: torch.Tensor  # [T] target input tokens
    positions: torch.Tensor  # [T] restart at 0 for each conversation
    doc: torch.Tensor  # [T] which conversation of the pack each token belongs to
    next_tok: torch.Tensor  # [T] token i+1 (the draft's input token at position i)
    weight: torch.Tensor  # [T] bool: position i has a loss (i+1 in the same conversation, in an assistant turn)
    n: int  # weight.sum()
    feats: torch.Tensor | None = None  # [T, d] target features

    @property
    def mask(self) -> torch.Tensor:
        """[T, T] bool: causal within each conversation (built on use: T^2 per pack would not fit cached)."""
        return (self.doc[:, None] == self.doc[None, :]).tril()


def tokenize(tok: Tokenizer, conversations: list[list[dict]], max_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Render each conversation with the chat template -> (token ids, assistant-token mask), cut at max_len.
    A token is an assistant token if it starts inside an assistant message's content, or is the first token
    after it (the end-of-turn the draft must also predict). apply_chat appends a generation prompt; its tokens
    are outside every assistant span, so they carry no loss."""
    texts = [tok.apply_chat(c) for c in conversations]
    tok.fast.enable_truncation(max_len)  # this Tokenizer instance is ours; avoids offsets of 20k-token chats
    out = []
    for conv, text, enc in zip(conversations, texts, tok.fast.encode_batch(texts, add_special_tokens=False)):
        ids = np.asarray(enc.ids, dtype=np.int64)
        starts = np.asarray([s for s, _ in enc.offsets])
        assistant = np.zeros(len(ids), dtype=bool)
        cursor = 0
        for m in conv:
            body = m["content"].strip()  # some templates trim the content
            at = text.find(body, cursor) if body else -1
            if at < 0:
                continue
            cursor = at + len(body)
            if m["role"] == "assistant":
                a, b = np.searchsorted(starts, [at, cursor])
                assistant[a:b + 1] = True
        if len(ids) > 1 and assistant[1:].any():
            out.append((ids, assistant))
    return out


def pack(seqs: list[tuple[np.ndarray, np.ndarray]], max_len: int, device) -> list[Pack]:
    """Greedy in-order packing of whole (already truncated) conversations into sequences of <= max_len tokens."""
    groups, cur, n = [], [], 0
    for s in seqs:
        if cur and n + len(s[0]) > max_len:
            groups.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += len(s[0])
    if cur:
        groups.append(cur)
    packs = []
    for g in groups:
        tokens = torch.from_numpy(np.concatenate([ids for ids, _ in g]))
        assistant = torch.from_numpy(np.concatenate([a for _, a in g]))
        doc = torch.cat([torch.full((len(ids),), j) for j, (ids, _) in enumerate(g)])
        positions = torch.cat([torch.arange(len(ids)) for ids, _ in g])
        same_next = torch.zeros(len(tokens), dtype=torch.bool)
        same_next[:-1] = doc[1:] == doc[:-1]
        weight = same_next & assistant.roll(-1)
        packs.append(Pack(tokens.to(device), positions.to(device), doc.to(device), tokens.roll(-1).to(device),
                          weight.to(device), int(weight.sum())))
    return packs


@torch.no_grad()  # not inference_mode: the cached features are later inputs of autograd graphs
def target_features(target: Transformer, packs: list[Pack], desc: str) -> None:
    for p in tqdm(packs, desc=desc, unit="seq", dynamic_ncols=True):
        slots = torch.arange(len(p.tokens), device=p.tokens.device)
        p.feats = target(p.tokens, p.positions, slots, p.mask)


def pack_loss(draft: EagleDraft, target: Transformer, p: Pack, noise: torch.Generator | None):
    """Summed (feature loss, token loss, correct top-1) over the weighted positions of one packed sequence."""
    feats = p.feats
    if noise is not None:
        feats = feats + (torch.rand(feats.shape, generator=noise, device=feats.device) * 2 - 1).to(feats.dtype) * NOISE
    T = len(p.tokens)
    cache = KVCache(replace(draft.cfg, max_seq_len=T), 1, _act_dtype(feats), feats.device)  # fresh: autograd
    slots = torch.arange(T, device=feats.device)
    h = draft.hidden(p.next_tok, feats, p.positions, slots, p.mask, cache=cache)
    sel = p.weight.nonzero().squeeze(-1)
    pred, want = h[sel].float(), p.feats[sel + 1].float()
    vloss = F.smooth_l1_loss(pred, want, reduction="none").mean(-1).sum()
    with torch.no_grad():
        target_logits = target.logits(p.feats[sel + 1]).float()
    logq = F.log_softmax(target.logits(h[sel]).float(), dim=-1)
    ploss = -(F.softmax(target_logits, dim=-1) * logq).sum()
    correct = (logq.argmax(-1) == target_logits.argmax(-1)).sum()
    return vloss, ploss, correct


def _act_dtype(feats: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if feats.is_cuda else torch.float32  # the draft's activations under autocast


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(draft: EagleDraft, target: Transformer, packs: list[Pack]) -> dict:
    draft.eval()
    v = p_ = c = n = 0.0
    for p in packs:
        with _autocast(p.tokens.device):
            vl, pl, cor = pack_loss(draft, target, p, None)
        v, p_, c, n = v + float(vl), p_ + float(pl), c + float(cor), n + p.n
    draft.train()
    n = max(n, 1.0)
    return {"loss": (v + CE_WEIGHT * p_) / n, "feature_loss": v / n, "token_loss": p_ / n, "acc": c / n,
            "positions": int(n)}


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1009 + epoch)).tolist()


def pack_order(n: int, seed: int, step: int, per_step: int) -> list[int]:
    """Pack indices of optimizer step `step`: a fresh permutation per epoch, from the seed and the epoch only."""
    return [_permutation(n, seed, g // n)[g % n] for g in range(step * per_step, (step + 1) * per_step)]


def init_draft(engine_dir: Path, target: Transformer, device, seed: int) -> EagleDraft:
    torch.manual_seed(seed)
    from ..engine.loader import read_config
    draft = EagleDraft(draft_config(read_config(engine_dir)), bias=False)  # Llama-3 EAGLE heads have no fc bias
    for m in draft.modules():  # the Hugging Face init EAGLE's heads start from
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    draft.setup(target, torch.float32, device)  # fp32 master weights; bf16 compute under autocast on CUDA
    return draft.requires_grad_(True).train()


def train(engine: str | Path, out: str | Path, conversations: int = 2000, max_len: int = 2048,
          steps: int | None = None, epochs: float = 1.0, lr: float = 3e-4, batch_tokens: int = 16384,
          seed: int = 0, device: str | None = None, resume: bool = False, save_every: int = 200,
          heldout: float = 0.02, time_limit: float | None = None, data: list[list[dict]] | None = None) -> dict:
    from ..data import sharegpt_conversations
    from ..engine.loader import load_target, pick_device
    from ..llm import resolve_engine

    t0 = time.perf_counter()
    engine_dir, out = resolve_engine(engine), Path(out)
    dev, dtype = pick_device(device)
    torch.manual_seed(seed)
    target, tok = load_target(engine_dir, dev, dtype, max_seq_len=max_len)
    convs = data if data is not None else sharegpt_conversations(conversations)
    n_held = max(1, round(heldout * len(convs)))
    if len(convs) <= n_held:
        raise UserError(f"need more than {n_held} conversations to hold {n_held} out, got {len(convs)}")
    train_packs = pack(tokenize(tok, convs[:-n_held], max_len), max_len, dev)
    held_packs = pack(tokenize(tok, convs[-n_held:], max_len), max_len, dev)

    per_step = max(1, batch_tokens // max_len)
    total = steps or math.ceil(epochs * len(train_packs) / per_step)
    draft = init_draft(engine_dir, target, dev, seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine to 10%
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
    key = {"engine": str(engine_dir.resolve()), "conversations": len(convs), "max_len": max_len, "seed": seed,
           "batch_tokens": batch_tokens, "total_steps": total}
    start = done = 0
    if resume:
        ck = out / CHECKPOINT
        if not ck.exists():
            raise UserError(f"--resume: no checkpoint at {ck}")
        state = torch.load(ck, map_location=dev, weights_only=True)
        if state["key"] != key:
            raise UserError(f"--resume: {ck} was made with other settings {state['key']}")
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = done = state["step"]
    target_features(target, train_packs, "target features (train)")
    target_features(target, held_packs, "target features (held-out)")
    before = evaluate(draft, target, held_packs)
    bar = tqdm(range(start, total), desc="train draft", unit="step", dynamic_ncols=True, initial=start, total=total)
    for step in bar:
        noise = torch.Generator(dev).manual_seed(seed * 1000003 + step)
        order = pack_order(len(train_packs), seed, step, per_step)
        n = max(1, sum(train_packs[i].n for i in order))
        loss = correct = 0
        for i in order:
            with _autocast(dev):
                vl, ploss, cor = pack_loss(draft, target, train_packs[i], noise)
            part = (vl + CE_WEIGHT * ploss) / n
            part.backward()
            loss, correct = loss + part.detach(), correct + cor
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)  # EAGLE's clip
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(correct) / n:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
        done = step + 1
        stop = time_limit is not None and time.perf_counter() - t0 > time_limit  # a budget, not a schedule
        if done % save_every == 0 or done == total or stop:
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"key": key, "step": done, "draft": draft.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, out / CHECKPOINT)
        if stop:
            break
    after = evaluate(draft, target, held_packs)
    save_draft(draft, out, engine_dir)
    return {"out": str(out), "steps": done, "planned_steps": total, "train_tokens": int(sum(len(p.tokens) for p in train_packs)),
            "heldout_loss_start": before["loss"], "heldout_acc_start": before["acc"],
            "heldout_loss": after["loss"], "heldout_acc": after["acc"], "heldout_positions": after["positions"],
            "wall_s": time.perf_counter() - t0}


def cmd_train_draft(a) -> None:
    r = train(a.engine, a.out, conversations=a.conversations, max_len=a.max_len, steps=a.steps, epochs=a.epochs,
              lr=a.lr, batch_tokens=a.batch_tokens, seed=a.seed, device=a.device, resume=a.resume,
              save_every=a.save_every, heldout=a.heldout, time_limit=a.time_limit)
    print(json.dumps(r))


def register(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE-1/2 draft head for an engine on ShareGPT")
    p.add_argument("--engine", required=True, help="engine directory or model key")
    p.add_argument("--out", required=True, help="draft directory (config.json + model.safetensors, checkpoint.pt)")
    p.add_argument("--conversations", type=int, default=2000, help="first N ShareGPT conversations")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per conversation and per packed sequence")
    p.add_argument("--steps", type=int, help="optimizer steps (default: from --epochs)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per optimizer step (whole packs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps")
    p.add_argument("--heldout", type=float, default=0.02, help="fraction of the conversations held out")
    p.add_argument("--time-limit", type=float, help="stop training (checkpoint, evaluate, save) after this many "
                                                    "seconds of wall time since the start")
    p.set_defaults(func=cmd_train_draft)
