"""The drafter's methods and gRPC face, and the scheduler's packing of verify windows."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.common.tensors import from_proto, ids, to_proto
from services.drafter.methods import CopyDrafter, DraftMethodUnavailable, MtpDrafter, build
from services.drafter.server import serve
from model.batch import Batch
from services.scheduler.batcher import build_step_plan, plan_round
from services.scheduler.request import Request, SamplingSpec, State
from twinspark.v1 import drafter_pb2, drafter_pb2_grpc


def test_copy_ngram_lookup():
    c = CopyDrafter()
    assert c.propose("r", [1, 2, 3, 4, 1, 2, 3], 4) == [4, 1, 2, 3]  # trigram 1 2 3 seen before
    assert c.propose("r", [9, 5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # bigram: its most recent occurrence
    assert c.propose("r", [1, 2, 3], 4) == []  # nothing repeats
    assert c.propose("r", [7, 7, 7, 7], 3) == [7, 7, 7]  # continued periodically over the drafts
    assert c.propose("r", [1, 2, 1], 0) == []


def test_methods_without_their_folders_refuse_clearly():
    with pytest.raises(DraftMethodUnavailable, match="user-supplied weights"):
        build("dflash2", None)
    with pytest.raises(DraftMethodUnavailable, match="needs --model"):
        build("mtp", None)


@pytest.mark.parametrize("ckpt", ["tiny_default", "tiny_fp8_head"])  # the MTP block scores with the target's lm_head
def test_mtp_drafts_are_forward_mtp_argmax(ckpt, request):
    path = request.getfixturevalue(ckpt)
    d = MtpDrafter(path, threshold=0.0, history=8)
    dim = d.model.cfg.hidden_size
    h = torch.randn(dim, generator=torch.Generator().manual_seed(0))
    drafts = d.propose("r", [5, 6, 7], 3, h)
    assert len(drafts) == 3 and all(0 <= t < d.model.cfg.vocab_size for t in drafts)
    # The first draft is the MTP block's argmax for (hidden, last token) at position 0, recomputed independently.
    cache = d.model.new_cache(num_blocks=2, block_size=16, num_slots=1)
    out = d.model.forward_mtp(Batch(token_ids=torch.tensor([7]), starts=[0], lengths=[1],
                                    block_tables=torch.tensor([[0, 1]]), slots=[0], logit_rows=torch.tensor([0]),
                                    hidden=h[None]), cache)
    assert drafts[0] == int(out.logits[0].argmax())
    assert d.propose("r", [5, 6, 7], 3, None) == []  # no hidden state, no MTP drafts
    assert MtpDrafter(path, threshold=1.1).propose("r", [5, 6, 7], 3, h) == []  # threshold stops the chain


def test_propose_over_grpc():
    server, port = serve(CopyDrafter(), "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            reply = stub.Propose(drafter_pb2.ProposeRequest(sequences=[
                drafter_pb2.DraftSequence(request_id="a", tokens=to_proto([1, 2, 3, 1, 2]), max_draft=2),
                drafter_pb2.DraftSequence(request_id="b", tokens=to_proto([4, 5]), max_draft=4)]), timeout=10)
        assert [ids(t) for t in reply.drafts] == [[3, 1], []]
    finally:
        server.stop(0)


def _running(rid: str, generated: int) -> Request:
    r = Request(request_id=rid, prompt=[1, 2, 3], max_tokens=20, sampling=SamplingSpec(0.8, 1.0, 0, 0.0, 9),
                stop_ids=frozenset(), eos_ids=frozenset(), priority=0, order=0, max_model_len=100)
    r.tokens += [10 + i for i in range(generated)]
    r.num_cached = len(r.tokens) - 1
    r.state = State.RUNNING
    from services.scheduler.pool import BlockPool
    r.reservation = BlockPool(8, 16, 4).reserve(r.reserve_tokens)
    return r


def test_verify_window_packing_and_budget():
    a, b = _running("a", 2), _running("b", 1)
    seqs = plan_round([a, b], budget=5, drafts={"a": [7, 8, 9], "b": [4, 4]})
    # Both decoders get their row first; drafts then fill the budget in order and are cut to fit.
    assert [(s.req.id, s.token_ids, s.verify) for s in seqs] == [("a", [11, 7, 8, 9], True), ("b", [10], False)]
    plan = build_step_plan(seqs, 16)
    assert from_proto(plan.sample_rows).tolist() == [0, 1, 2, 3, 4]  # every window row is sampled
    assert from_proto(plan.verify).tolist() == [1, 0]
    assert from_proto(plan.starts).tolist() == [4, 3]
    assert not build_step_plan(plan_round([a, b], budget=5), 16).HasField("verify")


def test_hostile_proposes_are_refused_and_the_drafter_keeps_serving(tiny_default):
    from services.common.internal_auth import metadata
    from services.drafter.server import MAX_DRAFT, MAX_SEQUENCES
    from twinspark.v1.tensor_pb2 import Tensor

    def seq(**kw) -> drafter_pb2.DraftSequence:
        base = dict(request_id="r", tokens=to_proto([1, 2, 3, 1, 2]), max_draft=2)
        return drafter_pb2.DraftSequence(**{**base, **kw})

    bad = [
        [seq(max_draft=2**31 - 1)], [seq(max_draft=MAX_DRAFT + 1)], [seq(max_draft=-1)],
        [seq(tokens=to_proto([1, -5, 3]))], [seq(tokens=to_proto([1.0, 2.0], "float32"))],
        [seq(tokens=Tensor(dtype="int32", shape=[4], data=b"\0" * 3))],
        [seq(tokens=Tensor(dtype="int32", shape=[2**33, 2**31], data=b""))],
        [seq(hidden=to_proto([1, 2, 3]))],
        [seq()] * (MAX_SEQUENCES + 1),
    ]
    mtp_bad = [[seq(tokens=to_proto([1, 10**7]))], [seq(hidden=to_proto(torch.zeros(3)))]]
    for method, cases in ((CopyDrafter(), bad), (MtpDrafter(tiny_default), mtp_bad)):
        server, port = serve(method, "127.0.0.1", 0, token="drafter-token")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = drafter_pb2_grpc.DrafterStub(ch)
                with pytest.raises(grpc.RpcError) as err:
                    stub.Propose(drafter_pb2.ProposeRequest(sequences=[seq()]), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                for sequences in cases:
                    with pytest.raises(grpc.RpcError) as err:
                        stub.Propose(drafter_pb2.ProposeRequest(sequences=sequences), timeout=10,
                                     metadata=metadata("drafter-token"))
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, sequences[0]
                reply = stub.Propose(drafter_pb2.ProposeRequest(sequences=[seq()]), timeout=10,
                                     metadata=metadata("drafter-token"))
                assert len(reply.drafts) == 1  # still serving
        finally:
            server.stop(0)
