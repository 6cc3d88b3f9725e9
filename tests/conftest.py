"""Shared fixtures: fixed seeds, CUDA cache cleanup, the GLUE folder beside the project."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import act_hf.compress


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    act_hf.compress.manual_seed(0)
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def glue_dir() -> Path:
    """The real GLUE TSVs (``$ACT_HF_GLUE_DIR`` or ``../shared/data/glue``); skips when absent."""
    path = Path(os.environ.get("ACT_HF_GLUE_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"))
    if not (path / "SST-2" / "train.tsv").exists():
        pytest.skip(f"GLUE data not found at {path} (set ACT_HF_GLUE_DIR)")
    return path
