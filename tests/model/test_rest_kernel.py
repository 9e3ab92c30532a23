"""model/rest_kernel.py on the CPU: the walk finds every projection once, and triton repacks nothing."""

from __future__ import annotations

import torch

from model import rest_kernel
from model.projection import COLUMNS, Projection


def test_walk_and_triton_leave_the_model_alone():
    p = Projection([torch.zeros(4, 8)], [4], [4], COLUMNS)
    q = Projection([torch.zeros(2, 8)], [2], [2], None)

    class Block:  # a block of this package's tree holds projections in attributes, lists and records
        __module__ = "model.fake"

        def __init__(self) -> None:
            self.qkv, self.parts, self.again = p, [q, {"x": p}], q

    root = Block()
    assert {id(x) for x in rest_kernel.projections(root)} == {id(p), id(q)}
    assert sum(1 for _ in rest_kernel.projections(root)) == 2
    assert "0 fp8 runs" in rest_kernel.prepare(root, "triton", 4, torch.bfloat16)
    assert isinstance(p.parts[0], torch.Tensor) and p.sharded and not q.sharded
