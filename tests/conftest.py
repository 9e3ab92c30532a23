"""Shared fixtures: tiny checkpoints written once per test session by `make-tiny`."""

from __future__ import annotations

from pathlib import Path

import pytest

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
