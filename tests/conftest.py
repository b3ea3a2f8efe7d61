"""Shared fixtures. Tests run offline on CPU; real data under ../shared/data is optional (skipped if absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("NEOBERT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def shared_data(*parts: str) -> Path:
    """A path under ../shared/data, or a skip when that real data is not on this machine."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data {path} is not available on this machine")
    return path


@pytest.fixture(autouse=True)
def _seed_threads_and_environment():
    """Each test starts from the same seed and environment. Lightning writes LOCAL_RANK, NODE_RANK and
    MASTER_PORT into os.environ during an in-process fit; left behind, a later `-m experiments.pretrain`
    subprocess with devices=2 believes a launcher already started its ranks and waits forever for rank 1."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # two xdist workers share two cores
    environment = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture
def tiny_config():
    from neobert.model import NeoBERTConfig

    return NeoBERTConfig.from_preset("tiny", vocab_size=1000, max_length=64)
