"""Shared fixtures: tiny checkpoints written once per test session by `make-tiny`.

Without a GPU, Triton kernels (kernels/gpu) run in Triton's CPU interpreter so their logic is tested against the
torch twins here too. The switch must be set before anything imports triton, hence at the top of this file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from services.rank_worker.model.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint (what `twinspark make-tiny` writes with no options)."""
    return make_tiny(tmp_path_factory.mktemp("tiny_default") / "ckpt")


@pytest.fixture(scope="session")
def tiny_sparse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3:1 KDA/MLA layout with index_topk (16) far below the test prompts, so DSA selection really drops tokens."""
    return make_tiny(tmp_path_factory.mktemp("tiny_sparse") / "ckpt", seed=1, index_topk=16)


@pytest.fixture(scope="session")
def tiny_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two adjacent MLA layers (3, 4) where layer 4 reuses layer 3's indexer selection — the only placement of a
    shared indexer layer that transformers supports — plus a full MLA layer 7."""
    return make_tiny(tmp_path_factory.mktemp("tiny_shared") / "ckpt", seed=2, index_topk=16,
                     layer_pattern="KKKMMKKM", indexer_pattern="FFFFSFFF")
