"""model/memory_parts.py: a loaded model's bytes by part, each storage once, and the log line bench reads back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import memory_parts
from model.model import Glm5Model
from services.cli import main as cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Glm5Model:
    out = tmp_path_factory.mktemp("tiny")
    assert cli(["make-tiny", "--out", str(out)]) == 0
    return Glm5Model.load(Path(out), progress=False)


def test_parts_sum_to_every_distinct_storage(tiny: Glm5Model) -> None:
    parts = memory_parts.bytes_by_part(tiny)
    assert list(parts) == [p for p in memory_parts.PARTS if p in parts]
    for p in ("routed experts", "KDA attention", "MLA attention + indexer", "embeddings", "lm_head", "MTP block"):
        assert parts[p] > 0, p
    embed = tiny.embed.untyped_storage().nbytes()
    assert parts["embeddings"] == embed
    # the routed stacks: gate, up and down of every MoE layer, nothing else
    moe = [layer.ffn.params for layer in tiny.layers if hasattr(layer.ffn, "params")]
    assert parts["routed experts"] == sum(t.untyped_storage().nbytes() for m in moe for t in (m.gate, m.up, m.down))


def test_a_shared_storage_is_counted_once(tiny: Glm5Model) -> None:
    before = memory_parts.bytes_by_part(tiny)
    tiny.alias = tiny.embed[:4]  # a view of the embeddings under another name: no new bytes
    try:
        assert memory_parts.bytes_by_part(tiny) == before
    finally:
        del tiny.alias
    assert memory_parts.bytes_by_part(tiny, torch.device("meta")) == {}


def test_line_round_trips() -> None:
    parts = {"routed experts": 3 << 30, "lm_head": 5 << 20}
    text = "start\nINFO " + memory_parts.line(parts) + "\nINFO more\n"
    assert memory_parts.parse(text) == {"routed experts": 3072.0, "lm_head": 5.0, "total": 3077.0}
    assert memory_parts.parse("nothing here") is None
