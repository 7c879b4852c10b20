"""Shared fixtures: the real SmolLM2-135M engine (fetched from PyPI and built once into the cache) and a
randomly initialised EAGLE head for it (enough for losslessness, which must hold for any draft)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trtllm_microspec.llm import resolve_engine
from trtllm_microspec.models.model import ModelConfig
from trtllm_microspec.speculative.eagle import EagleDraft, draft_config, save_draft


@pytest.fixture(scope="session")
def engine_dir() -> Path:
    return resolve_engine("smollm2-135m")


@pytest.fixture(scope="session")
def random_draft_dir(engine_dir, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = draft_config(ModelConfig.load(engine_dir / "config.json"))
    out = tmp_path_factory.mktemp("draft")
    save_draft(EagleDraft(cfg, bias=False), out, engine_dir)
    return out
