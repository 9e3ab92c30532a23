"""services/common/tensors.py: what goes into a `Tensor` message comes back the same, lists packed through numpy
the same as tensors through torch, and bytes that do not match their dtype and shape are refused."""

from __future__ import annotations

import pytest
import torch

from services.common.tensors import from_proto, ids, to_proto
from twinspark.v1.tensor_pb2 import Tensor


@pytest.mark.parametrize("values, dtype", [([3, -1, 7], None), ([0.5, -1.25], "float32"), ([[1, 2], [3, 4]], None),
                                           ([2**40, -5], "int64"), ([], None), ([True, False], None)])
def test_list_packs_as_its_tensor(values: list, dtype: str | None) -> None:
    want = torch.tensor(values, dtype={"int32": torch.int32, "int64": torch.int64,
                                       "float32": torch.float32}[dtype or "int32"])
    msg = to_proto(values, dtype)
    assert msg == to_proto(want)  # the same message whichever way it was packed
    assert torch.equal(from_proto(msg), want)


def test_bfloat16_round_trip() -> None:
    t = torch.tensor([[1.5, -2.0, 3.25]], dtype=torch.bfloat16)
    assert torch.equal(from_proto(to_proto(t)), t)


def test_ids() -> None:
    assert ids(to_proto([5, 6, 7])) == [5, 6, 7]
    assert ids(to_proto([2**40], "int64")) == [2**40]
    assert ids(to_proto([])) == []


@pytest.mark.parametrize("msg", [to_proto([[1, 2]]), to_proto([1.0], "float32"),
                                 Tensor(dtype="int32", shape=[3], data=b"\0" * 8),
                                 Tensor(dtype="int32", shape=[-2], data=b""),
                                 Tensor(dtype="int8", shape=[1], data=b"\0")])
def test_ids_refuses_what_is_not_a_list_of_ids(msg: Tensor) -> None:
    with pytest.raises(ValueError):
        ids(msg)


@pytest.mark.parametrize("msg", [Tensor(dtype="int32", shape=[2, 2], data=b"\0" * 12),
                                 Tensor(dtype="int64", shape=[-1, -4], data=b"\0" * 32),
                                 Tensor(dtype="complex", shape=[1], data=b"\0" * 8)])
def test_from_proto_refuses_bytes_that_do_not_match(msg: Tensor) -> None:
    with pytest.raises(ValueError):
        from_proto(msg)
