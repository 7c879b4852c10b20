"""`microspec build-freq`: the FR-Spec token-frequency list of an engine (its static draft vocabulary).

Counts the target tokenizer's ids over a corpus of raw text and writes `<engine>/token_freq.safetensors`
(`train-draft` writes the same file beside the head it trains, counted over its training answers; an engine
without its own ranking uses its draft's):
  ranked_ids  int64 [V]  every id of the engine's vocabulary, by count descending, ties by id ascending
  counts      int64 [V]  the count of each id, indexed by id (so counts[ranked_ids] is non-increasing)
Corpus: `sharegpt` (the text of every message of every conversation), a .txt file (one document per line,
as FR-Spec counts SlimPajama lines) or a .jsonl file (the "text" field of each line).

Chat-template tokens are not counted: FR-Spec counts raw text, and the draft vocabulary only has to cover
what the target generates inside an answer. The one special token an answer emits is its end-of-turn/EOS,
and the frspec strategy pins the engine's EOS ids into the vocabulary whatever their rank.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.registry import UserError

FREQ_FILE = "token_freq.safetensors"  # the ranking's file name, in an engine's directory or a head's
BATCH = 1024  # documents per tokenizer call (the Rust tokenizer parallelises within a batch)


def corpus_texts(corpus: str, limit: int | None = None) -> list[str]:
    """Documents of the corpus: `limit` conversations (sharegpt) or lines (.txt/.jsonl) at most."""
    if corpus == "sharegpt":
        from ..data import sharegpt_conversations
        return [m["content"] for conv in sharegpt_conversations(limit) for m in conv]
    p = Path(corpus)
    if not p.is_file() or p.suffix not in (".txt", ".jsonl"):
        raise UserError(f"corpus {corpus} is neither 'sharegpt' nor a .txt/.jsonl file")
    texts = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines(keepends=True)  # a .txt line keeps its newline token
    except UnicodeDecodeError as e:
        raise UserError(f"corpus {p} is not UTF-8 text (byte {e.start})") from None
    for i, line in enumerate(lines[:limit]):
        if p.suffix == ".txt":
            texts.append(line)
        elif line.strip():
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise UserError(f"{p}:{i + 1}: not a JSON line ({e})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise UserError(f"{p}:{i + 1}: a .jsonl corpus needs a \"text\" string on every line")
            texts.append(rec["text"])
    return texts


def count_tokens(tokenizer, texts: list[str], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(0, len(texts), BATCH):
        encs = tokenizer.fast.encode_batch(texts[i:i + BATCH], add_special_tokens=False)
        ids = torch.tensor([t for e in encs for t in e.ids], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def rank(counts: torch.Tensor) -> torch.Tensor:
    # stable sort of ids 0..V-1 by -count: ties keep ascending id order
    return torch.sort(-counts, stable=True).indices


def save_ranking(out: Path, counts: torch.Tensor) -> Path:
    """A ranking file (the format above) from per-id counts: build-freq's of an engine, train-draft's of a head
    (the counts of its training answers' tokens, beside the head)."""
    from safetensors.torch import save_file

    save_file({"ranked_ids": rank(counts), "counts": counts.long().contiguous()}, out)
    return out


def build_freq(engine_dir: Path, corpus: str = "sharegpt", limit: int | None = None) -> Path:
    from ..engine.loader import read_config
    from ..models.tokenizer import Tokenizer

    if limit is not None and limit < 1:
        raise UserError(f"--limit must be at least 1, got {limit}")
    cfg = read_config(engine_dir)
    counts = count_tokens(Tokenizer(engine_dir), corpus_texts(corpus, limit), cfg.vocab_size)
    if not counts.any():  # all-zero counts would replace a good ranking with plain id order
        raise UserError(f"corpus {corpus} holds no text to count; {FREQ_FILE} is left as it was")
    return save_ranking(Path(engine_dir) / FREQ_FILE, counts)


def cmd_build_freq(a) -> None:
    from ..llm import resolve_engine

    print(build_freq(resolve_engine(a.engine), a.corpus, a.limit))


def register(sub) -> None:
    p = sub.add_parser("build-freq", help="FR-Spec token frequencies of a corpus -> <engine>/token_freq.safetensors")
    p.add_argument("--engine", required=True, help="engine directory or model key")
    p.add_argument("--corpus", default="sharegpt", help="'sharegpt', or a .txt (one document per line) / "
                                                         ".jsonl (\"text\" field) file")
    p.add_argument("--limit", type=int, help="at most this many conversations / lines")
    p.set_defaults(func=cmd_build_freq)
