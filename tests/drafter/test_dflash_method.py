"""DFlash drafts end to end below the stack: the target layers' outputs the ranks return, the drafter method that
keeps them by position, its gRPC checks, and the scheduler's pending rows."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from model.batch import Batch
from model.dflash import load_drafter
from model.model import Glm5Model
from ops.reference import rms_norm
from services.common.tensors import to_proto
from services.drafter.dflash import DFlashDraftMethod
from services.drafter.methods import DraftMethodUnavailable, build
from services.drafter.server import serve
from services.scheduler.drafts import DraftRows
from twinspark.v1 import drafter_pb2, drafter_pb2_grpc


def _forward(model: Glm5Model, tokens: list[int], layers: tuple[int, ...] = ()):
    cache = model.new_cache(num_blocks=4, block_size=16, num_slots=1)
    n = len(tokens)
    batch = Batch(token_ids=torch.tensor(tokens), starts=[0], lengths=[n], block_tables=torch.arange(4)[None],
                  slots=[0], logit_rows=torch.tensor([n - 1]), prompt=[True])
    return model.forward(batch, cache, layers=layers)


def test_layer_outputs_are_the_stream_means(tiny_dflash: Path) -> None:
    """The rows DFlash reads: layer outputs collapsed by the plain mean of the mHC streams, in the asked order,
    and asking for them changes nothing else."""
    model = Glm5Model.load(tiny_dflash, progress=False)
    last = model.cfg.num_hidden_layers - 1
    tokens = [5, 9, 17, 3, 3, 40, 2]
    plain = _forward(model, tokens)
    out = _forward(model, tokens, layers=(last, 1))
    d = model.cfg.hidden_size
    assert out.layers is not None and tuple(out.layers.shape) == (len(tokens), 2 * d)
    assert torch.equal(out.logits, plain.logits) and torch.equal(out.hidden, plain.hidden)
    # The last layer's collapse is what the final norm reads: normed, it is the final hidden state.
    assert torch.equal(rms_norm(out.layers[:, :d], model.norm, model.cfg.rms_norm_eps), out.hidden)
    assert plain.layers is None


def _method(ckpt: Path) -> DFlashDraftMethod:
    return DFlashDraftMethod(ckpt / "dflash2", ckpt)


def _reference(ckpt: Path, rows: torch.Tensor, tokens: list[int]) -> list[int]:
    """The drafter's own propose over the whole context (positions 0 .. n - 2), with the target's weights."""
    method = _method(ckpt)
    drafter = load_drafter(ckpt / "dflash2")
    anchor = len(tokens) - 1
    block = drafter.mask_block(torch.tensor([tokens[-1]]))
    positions = torch.arange(anchor + drafter.config.block_size)[None]
    with torch.inference_mode():
        return drafter.propose(rows[None, :anchor], block, positions, method.embed, method.head)[0].tolist()


def test_drafts_equal_the_drafter_over_the_whole_context(tiny_dflash: Path) -> None:
    method = _method(tiny_dflash)
    gen = torch.Generator().manual_seed(0)
    tokens = [int(t) for t in torch.randint(0, method.config.vocab_size, (21,), generator=gen)]
    rows = torch.randn(len(tokens), method.row_width, generator=gen)
    want = _reference(tiny_dflash, rows, tokens)
    assert len(want) == method.config.block_size - 1
    # A prompt chunk, then rows one round at a time; each call drafts from the context so far.
    assert method.propose("r", tokens[:13], 4, rows[:12], 0) == _reference(tiny_dflash, rows, tokens[:13])[:4]
    for n in range(13, len(tokens)):
        drafts = method.propose("r", tokens[: n + 1], 20, rows[n - 1 : n], n - 1)
    assert drafts == want  # capped by the block: block_size - 1 drafts at most
    # A resend overlapping what the method holds (a reply the scheduler missed) replaces those rows.
    assert method.propose("r", tokens, 3, rows[15:20], 15) == want[:3]
    # A context that does not reach the anchor gets no drafts; rows after a gap start the context anew.
    assert method.propose("r", tokens + [1, 2], 3) == []
    assert method.propose("s", tokens, 3, rows[5:20], 5) != []
    assert method.propose("t", tokens, 3) == []
    assert method.propose("u", tokens[:5], 3, rows[8:10], 8) == []  # rows all after the anchor: nothing before it


def test_dflash_propose_checks_over_grpc(tiny_dflash: Path) -> None:
    method = build("dflash2", str(tiny_dflash), weights=str(tiny_dflash / "dflash2"))
    server, port = serve(method, "127.0.0.1", 0)
    width = method.row_width
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)

            def propose(**kw) -> list[int]:
                seq = drafter_pb2.DraftSequence(request_id="r", tokens=to_proto([1, 2, 3]), max_draft=2, **kw)
                return stub.Propose(drafter_pb2.ProposeRequest(sequences=[seq]), timeout=30).drafts

            for bad in (dict(hidden=to_proto(torch.zeros(2, width + 1))), dict(hidden=to_proto(torch.zeros(width))),
                        dict(hidden=to_proto(torch.zeros(2, width)), hidden_start=-1)):
                with pytest.raises(grpc.RpcError) as err:
                    propose(**bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(propose(hidden=to_proto(torch.zeros(2, width)), hidden_start=0)[0].data) == 2 * 4
    finally:
        server.stop(0)


def test_build_needs_both_folders(tiny_dflash: Path) -> None:
    with pytest.raises(DraftMethodUnavailable, match="needs --dflash2-weights"):
        build("dflash2", str(tiny_dflash))
    with pytest.raises(DraftMethodUnavailable, match="--method dflash2: DFlash2 config lacks"):
        build("dflash2", str(tiny_dflash), weights=str(tiny_dflash))  # the target's folder is no drafter


def test_pending_rows_are_contiguous() -> None:
    rows = DraftRows()
    assert rows.pending(1 << 20) is None
    rows.add(0, torch.zeros(3, 2))
    rows.add(3, torch.ones(1, 2))
    pending = rows.pending(1 << 20)
    assert pending is not None and pending.shape[0] == 4 and rows.start == 0
    part = rows.pending(2 * 8)  # two rows of two fp32 values fit
    assert part is not None and part.shape[0] == 2 and rows.pending(4) is None
    rows.delivered(2)
    pending = rows.pending(1 << 20)
    assert rows.start == 2 and pending is not None and pending[:, 0].tolist() == [0.0, 1.0]
    rows.delivered(2)
    assert rows.pending(1 << 20) is None and rows.start == 4
    rows.add(4, torch.ones(2, 2))
    rows.add(9, torch.full((1, 2), 7.0))  # a gap: the rows before it are no use to the drafter
    pending = rows.pending(1 << 20)
    assert rows.start == 9 and pending is not None and pending.tolist() == [[7.0, 7.0]]
