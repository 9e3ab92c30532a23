"""The real scheduler (stand-in ranks) against hand-crafted Generate calls and callers without the internal token:
every bad call gets an error status, nothing is queued, and the scheduler keeps serving."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from services.common.internal_auth import aio_channel
from services.common.tensors import to_proto
from services.scheduler.ranks import RankSet, StartupError
from tests.scheduler.harness import cluster, generate
from tests.scheduler.standin_rank import StandinRank
from twinspark.v1 import generate_pb2, generate_pb2_grpc
from twinspark.v1.tensor_pb2 import Tensor

TOKEN = "scheduler-test-token"


def run(coro):
    return asyncio.run(coro)


def _request(**fields) -> generate_pb2.GenerateRequest:
    base = dict(request_id="", prompt_ids=to_proto([1, 2, 3]), sampling=generate_pb2.Sampling(temperature=0.0),
                max_tokens=4)
    return generate_pb2.GenerateRequest(**{**base, **fields})


HOSTILE = [
    ("float prompt ids", _request(prompt_ids=to_proto([1.5, 2.0], "float32"))),
    ("bytes that do not fill the shape", _request(prompt_ids=Tensor(dtype="int32", shape=[9], data=b"\0" * 7))),
    ("a shape that overflows int64", _request(prompt_ids=Tensor(dtype="int32", shape=[2**32, 2**32]))),
    ("a 2-d prompt", _request(prompt_ids=Tensor(dtype="int32", shape=[1, 2], data=b"\0" * 8))),
    ("unknown dtype", _request(prompt_ids=Tensor(dtype="float64", shape=[1], data=b"\0" * 8))),
    ("negative id", _request(prompt_ids=to_proto([1, -7]))),
    ("id beyond the vocabulary", _request(prompt_ids=to_proto([1, 2**31 - 1]))),
    ("huge prompt", _request(prompt_ids=to_proto([1] * 200_000))),
    ("negative max_tokens", _request(max_tokens=-(2**31))),
    ("max_tokens past the window", _request(max_tokens=2**31 - 1)),
    ("NaN temperature", _request(sampling=generate_pb2.Sampling(temperature=math.nan))),
    ("infinite temperature", _request(sampling=generate_pb2.Sampling(temperature=math.inf))),
    ("top_p above 1", _request(sampling=generate_pb2.Sampling(top_p=7.0))),
    ("NaN min_p", _request(sampling=generate_pb2.Sampling(min_p=math.nan))),
    ("negative top_k", _request(sampling=generate_pb2.Sampling(top_k=-1))),
    ("unknown priority", _request(priority=77)),
    ("a request id of 100k characters", _request(request_id="x" * 100_000)),
    ("100k stop token ids", _request(stop_token_ids=list(range(100_000)))),
]


@pytest.mark.parametrize("what,req", HOSTILE, ids=[w for w, _ in HOSTILE])
def test_hostile_generate_is_refused_and_serving_goes_on(what, req):
    async def body():
        async with cluster(1, token=TOKEN) as c:  # vocab 1000, window 256
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.stub.Generate(req, timeout=10).read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.value.details())
            health = await c.health()
            assert health.waiting == 0 and health.running == 0
            assert (await generate(c, [1, 2, 3], 3)).reason == "length"
    run(body())


def test_callers_without_the_token_are_refused():
    async def body():
        async with cluster(1, token=TOKEN) as c:
            for token in (None, "wrong"):
                channel = aio_channel(f"127.0.0.1:{c.scheduler.port}", token)
                stub = generate_pb2_grpc.GeneratorStub(channel)
                for call in (stub.Health(generate_pb2.HealthRequest(), timeout=5),
                             stub.Generate(_request(), timeout=5).read(),
                             stub.Abort(generate_pb2.AbortRequest(request_id="x"), timeout=5)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await channel.close()
            assert (await generate(c, [4, 5], 2)).reason == "length"
    run(body())


def test_scheduler_with_another_token_is_refused_by_the_ranks_at_once():
    async def body():
        rank = StandinRank(token="the-ranks-token")
        ranks = RankSet([await rank.start()], token="another-token")
        try:
            with pytest.raises(StartupError, match="refused the scheduler's internal token"):
                await ranks.connect(startup_timeout_s=30)
        finally:
            await ranks.close()
            await rank.stop()
    run(body())


def test_a_plan_every_rank_refuses_fails_its_requests_only():
    """StepResult.refused from every rank: the round's requests fail, the ranks are not declared dead."""
    async def body():
        async with cluster(2, rank=dict(fail_at_round=2, fail_mode="refuse")) as c:
            first = await generate(c, [1, 2, 3], 5)
            assert first.reason == "error" and "refused" in first.finished.error
            health = await c.health()
            assert health.healthy and all(comp.alive for comp in health.components)
            assert (await generate(c, [1, 2, 3], 5)).reason == "length"
    run(body())
