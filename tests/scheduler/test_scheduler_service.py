"""The real scheduler gRPC server in front of stand-in ranks (tests/scheduler/standin_rank.py), via a grpc.aio client.

The stand-in's tokens depend on every earlier token as read back through the block table, so any batching,
chunking, block-table, slot or ordering mistake changes a reply; each reply is compared with what the same
request gets alone (`standin_generate`, and the same server serving it alone).
"""

from __future__ import annotations

import asyncio
import collections
import random
import socket

import grpc
import pytest

from services.common.tensors import from_proto, to_proto
from services.scheduler.engine import PIPELINE_DEPTH
from services.scheduler.ranks import RankSet, StartupError
from services.scheduler.request import derive_seed
from tests.scheduler.harness import Reply, cluster, collect, generate, make_request, wait_until
from tests.scheduler.standin_rank import StandinRank, standin_generate
from twinspark.v1 import generate_pb2, rank_pb2

pytestmark = pytest.mark.timeout(60)
VOCAB = 1000


def run(coro) -> None:
    asyncio.run(coro)


def _pool_empty(h: generate_pb2.HealthReply) -> bool:
    return (h.pool.free_blocks == h.pool.total_blocks and h.pool.free_slots == h.pool.total_slots
            and h.running == 0 and h.waiting == 0)


def test_single_request_matches_standin_and_seeds():
    async def body():
        async with cluster(2) as c:
            prompt = list(range(3, 22))
            r = await generate(c, prompt, 12, rid="one")
            assert r.tokens == standin_generate(prompt, 12, vocab=VOCAB)[0]
            first = r.events[0]
            assert first.HasField("progress") and first.progress.phase == generate_pb2.PHASE_QUEUED
            f = r.finished
            assert (r.reason, f.prompt_tokens, f.completion_tokens, f.stop_token_id) == ("length", 19, 12, -1)
            assert f.queue_s >= 0 and f.prefill_s >= 0 and f.decode_s >= 0 and f.error == ""
            # No seed: derived from the prompt, so the same sampled request gets the same reply.
            a = await generate(c, prompt, 8, temperature=0.7)
            b = await generate(c, prompt, 8, temperature=0.7)
            assert a.tokens == b.tokens == standin_generate(prompt, 8, vocab=VOCAB, temperature=0.7,
                                                            seed=derive_seed(prompt))[0]
            s = await generate(c, prompt, 8, temperature=0.7, seed=2**64 - 5)  # top bit set: travels as int64
            assert s.tokens == standin_generate(prompt, 8, vocab=VOCAB, temperature=0.7, seed=2**64 - 5)[0]
            assert s.tokens != a.tokens
            # a finished request's blocks come free once the round in flight with its rows is back
            await wait_until(lambda: _pool_empty_async(c))
            assert not c.standin_errors()
    run(body())


def test_sixteen_concurrent_requests_equal_alone_and_pool_empties():
    rng = random.Random(7)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 70, 4, 9, 17, 26, 40, 6]
    reqs = []
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(VOCAB) for _ in range(n)]
        temp = 0.0 if i % 3 else 0.9
        reqs.append(dict(prompt=prompt, max_tokens=rng.randint(1, 30), temperature=temp))

    async def body():
        # A small pool (160 tokens of cache for ~540 wanted, 6 slots) and a 70-token budget (6 decode rows + one
        # 64-token grid chunk): requests wait for blocks and slots, decodes and prefills share rounds.
        async with cluster(1, rank=dict(num_blocks=40, block_size=4, num_slots=6, max_model_len=96,
                                        step_delay_s=0.002), max_num_seqs=6, max_num_batched_tokens=70) as c:
            together = await asyncio.gather(*(generate(c, r["prompt"], r["max_tokens"], rid=f"r{i}",
                                                       temperature=r["temperature"]) for i, r in enumerate(reqs)))
            await wait_until(lambda: _pool_empty_async(c))
            busiest = max(len(rl.seqs) for rl in c.ranks[0].rounds)
            # Once a request samples, it samples in every round until it finishes (decode rows come first).
            sampled_rounds: dict[str, list[int]] = {}
            for rl in c.ranks[0].rounds:
                for rid, _, _, smp in rl.seqs:
                    if smp:
                        sampled_rounds.setdefault(rid, []).append(rl.round)
            for rid, rounds in sampled_rounds.items():
                assert rounds == list(range(rounds[0], rounds[0] + len(rounds))), rid
            alone = [await generate(c, r["prompt"], r["max_tokens"], temperature=r["temperature"]) for r in reqs]
            for r, t, a in zip(reqs, together, alone):
                ref = standin_generate(r["prompt"], r["max_tokens"], vocab=VOCAB, temperature=r["temperature"],
                                       seed=derive_seed(r["prompt"]))[0]
                assert t.tokens == a.tokens == ref
                assert t.reason == "length" and t.finished.completion_tokens == r["max_tokens"]
            assert busiest >= 4  # they really were batched together
            # a finished request's blocks come free once the round in flight with its rows is back
            await wait_until(lambda: _pool_empty_async(c))
            assert not c.standin_errors()
    run(body())


def test_long_prompt_is_chunked_while_other_streams_decode_every_round():
    async def body():
        async with cluster(1, rank=dict(num_blocks=96, block_size=4, step_delay_s=0.002),
                           max_num_batched_tokens=80) as c:
            short = list(range(5))
            a = Reply()
            task_a = asyncio.ensure_future(collect(c.stub.Generate(make_request(short, 60, rid="A"), timeout=20), a))
            await wait_until(lambda: _true(len(a.tokens) > 0))
            long_prompt = [(7 * i + 3) % VOCAB for i in range(200)]
            b = await generate(c, long_prompt, 5, rid="B")
            await task_a
            assert a.tokens == standin_generate(short, 60, vocab=VOCAB)[0]
            assert b.tokens == standin_generate(long_prompt, 5, vocab=VOCAB)[0]
            chunks = []
            for rl in c.ranks[0].rounds:
                rows = {rid: (start, n, sampled) for rid, start, n, sampled in rl.seqs}
                if "B" in rows and rows["B"][0] < 200:  # a prefill round of B
                    chunks.append(rows["B"])
                    assert "A" in rows and rows["A"][1:] == (1, True), "A must decode in every round"
            # budget 80 minus A's decode row leaves 79: every chunk but the last ends on the 64-token KDA grid
            assert [(s, n) for s, n, _ in chunks] == [(0, 64), (64, 64), (128, 72)]
            assert [s for s, _, _ in chunks] == [sum(n for _, n, _ in chunks[:i]) for i in range(len(chunks))]
            assert [smp for _, _, smp in chunks] == [False] * (len(chunks) - 1) + [True]
            assert any(e.HasField("progress") and e.progress.phase == generate_pb2.PHASE_PREFILLING
                       and e.progress.prefilled > 0 for e in b.events)
    run(body())


async def _true(v: bool) -> bool:
    return v


def test_queue_full_retry_after_and_queued_keepalives():
    async def body():
        async with cluster(1, rank=dict(step_delay_s=0.01), max_num_seqs=1, max_waiting=1,
                           progress_interval_s=0.05) as c:
            a, b = Reply(), Reply()
            ta = asyncio.ensure_future(collect(c.stub.Generate(make_request([1, 2, 3], 200, rid="A")), a))
            await wait_until(lambda: _true(len(a.tokens) > 0))
            tb = asyncio.ensure_future(collect(c.stub.Generate(make_request([4, 5], 5, rid="B")), b))
            await wait_until(lambda: _true(len(b.events) >= 3))  # QUEUED at acceptance, then keepalives
            assert all(e.progress.phase == generate_pb2.PHASE_QUEUED for e in b.events[:3])
            call = c.stub.Generate(make_request([6], 5, rid="C"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(call)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            retry = dict(err.value.trailing_metadata() or ())["retry-after"]
            assert int(retry) >= 1
            # Aborting the queued one finishes it at once; the running one within a round.
            assert (await c.stub.Abort(generate_pb2.AbortRequest(request_id="B"))).found
            assert (await c.stub.Abort(generate_pb2.AbortRequest(request_id="A"))).found
            await asyncio.gather(ta, tb)
            assert a.reason == b.reason == "aborted" and b.tokens == []
            await wait_until(lambda: _pool_empty_async(c))
    run(body())


def test_max_waiting_zero_still_runs_what_fits_now():
    async def body():
        async with cluster(1, rank=dict(step_delay_s=0.01), max_num_seqs=1, max_waiting=0) as c:
            a = Reply()
            ta = asyncio.ensure_future(collect(c.stub.Generate(make_request([1, 2], 30, rid="A")), a))
            await wait_until(lambda: _true(len(a.events) > 0))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c, [3], 2)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await ta
            assert a.tokens == standin_generate([1, 2], 30, vocab=VOCAB)[0]
    run(body())


def test_invalid_requests():
    async def body():
        async with cluster(1) as c:  # vocab 1000, window 256
            cases = [([1] * 200, 57, "context_length_exceeded"), ([1, 1000], 4, "invalid_token_id"),
                     ([-1], 4, "invalid_token_id"), ([], 4, "invalid_prompt"), ([1], -1, "invalid_max_tokens")]
            for prompt, max_tokens, code in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(c, prompt, max_tokens)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(code + ": "), err.value.details()
            ok = await generate(c, [1] * 200, 56)  # exactly the window
            assert ok.reason == "length" and len(ok.tokens) == 56
            await wait_until(lambda: _pool_empty_async(c))
    run(body())


def test_abort_and_client_cancellation_free_blocks_within_a_round():
    async def body():
        async with cluster(1, rank=dict(step_delay_s=0.005)) as c:
            a = Reply()
            ta = asyncio.ensure_future(collect(c.stub.Generate(make_request([9] * 10, 200, rid="A")), a))
            await wait_until(lambda: _true(len(a.tokens) >= 3))
            assert (await c.stub.Abort(generate_pb2.AbortRequest(request_id="A"))).found
            await ta
            assert a.reason == "aborted" and 3 <= len(a.tokens) < 200
            assert a.tokens == standin_generate([9] * 10, 200, vocab=VOCAB)[0][: len(a.tokens)]
            await wait_until(lambda: _pool_empty_async(c))
            assert not (await c.stub.Abort(generate_pb2.AbortRequest(request_id="A"))).found

            b = Reply()
            call = c.stub.Generate(make_request([8] * 10, 200, rid="B"))
            tb = asyncio.ensure_future(collect(call, b))
            await wait_until(lambda: _true(len(b.tokens) >= 3))
            call.cancel()
            seen_at_cancel = len(c.ranks[0].rounds)
            with pytest.raises(asyncio.CancelledError):
                await tb
            await wait_until(lambda: _pool_empty_async(c), timeout_s=2)
            later = [rl for rl in c.ranks[0].rounds[seen_at_cancel:] if any(s[0] == "B" for s in rl.seqs)]
            assert len(later) <= PIPELINE_DEPTH  # the rounds in flight when the cancel arrived
            assert not c.standin_errors()
    run(body())


async def _pool_empty_async(c) -> bool:
    return _pool_empty(await c.health())


def test_stop_token_ids_eos_and_max_tokens():
    prompt = [11, 22, 33, 44]
    ref = standin_generate(prompt, 30, vocab=VOCAB)[0]
    i = next(k for k in range(3, 30) if ref[k] not in ref[:k])
    stop = ref[i]

    async def body():
        async with cluster(1) as c:
            r = await generate(c, prompt, 30, stop_token_ids=[stop])
            # The stopping id is streamed too (the gateway hides it from text).
            assert r.tokens == ref[: i + 1] and r.reason == "stop" and r.finished.stop_token_id == stop
            r = await generate(c, prompt, 7)
            assert r.tokens == ref[:7] and r.reason == "length" and r.finished.stop_token_id == -1
            r = await generate(c, prompt, i + 1, stop_token_ids=[stop])  # stop and length on the same token
            assert r.reason == "stop"
        async with cluster(1, rank=dict(eos=(stop,))) as c:
            r = await generate(c, prompt, 30)
            assert r.tokens == ref[: i + 1] and r.reason == "stop" and r.finished.stop_token_id == stop
            r = await generate(c, prompt, 30, ignore_eos=True)
            assert r.tokens == ref and r.reason == "length"
            await wait_until(lambda: _pool_empty_async(c))
    run(body())


def test_background_priority_is_served_after_normal():
    async def body():
        async with cluster(1, rank=dict(step_delay_s=0.003), max_num_seqs=1) as c:
            a, b, n = Reply(), Reply(), Reply()
            ta = asyncio.ensure_future(collect(c.stub.Generate(make_request([1] * 4, 20, rid="A")), a))
            await wait_until(lambda: _true(len(a.tokens) > 0))
            tb = asyncio.ensure_future(collect(c.stub.Generate(make_request(
                [2] * 4, 5, rid="BG", priority=generate_pb2.PRIORITY_BACKGROUND)), b))
            await wait_until(lambda: _true(len(b.events) > 0))
            tn = asyncio.ensure_future(collect(c.stub.Generate(make_request([3] * 4, 5, rid="N")), n))
            await asyncio.gather(ta, tb, tn)
            first = {}
            for rl in c.ranks[0].rounds:
                for rid, *_ in rl.seqs:
                    first.setdefault(rid, rl.round)
            assert first["A"] < first["N"] < first["BG"]
            assert b.tokens == standin_generate([2] * 4, 5, vocab=VOCAB)[0]
    run(body())


@pytest.mark.parametrize("mode", ["stop", "error"])
def test_rank_failure_fails_in_flight_and_health_names_the_rank(mode):
    async def body():
        async with cluster(2, rank=dict(step_delay_s=0.002),
                           per_rank=[{}, {"fail_at_round": 6, "fail_mode": mode}]) as c:
            replies = await asyncio.gather(*(generate(c, [i + 1] * 5, 100, rid=f"q{i}") for i in range(3)))
            for r in replies:
                assert r.reason == "error" and "rank1" in r.finished.error, r.finished
                if mode == "error":
                    assert "injected failure" in r.finished.error
            h = await c.health()
            comps = {x.name: x for x in h.components}
            assert not h.healthy and not comps["rank1"].alive and comps["rank0"].alive and comps["scheduler"].alive
            assert "rank1" not in comps["rank0"].detail
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c, [1, 2], 3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "rank1" in err.value.details()
            assert h.pool.free_blocks == h.pool.total_blocks and h.running == 0
    run(body())


def test_startup_waits_for_late_ranks_and_refuses_mismatched_groups():
    async def body():
        # A rank that comes up late is waited for.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        late = StandinRank(port=port)
        rs = RankSet([f"127.0.0.1:{port}"])
        connecting = asyncio.ensure_future(rs.connect(startup_timeout_s=10))
        await asyncio.sleep(0.3)
        await late.start()
        info = await connecting
        assert info.model == "standin" and info.num_blocks == 64
        await rs.close()
        await late.stop()

        # Different fingerprints, and ranks listed out of order: refused, naming the ranks.
        r0, r1 = StandinRank(rank=0, world=2), StandinRank(rank=1, world=2, fingerprint="other")
        a0, a1 = await r0.start(), await r1.start()
        for addrs, words in (([a0, a1], ["fingerprints differ", "rank1"]), ([a1, a0], ["rank order", "rank0"])):
            rs = RankSet(addrs)
            with pytest.raises(StartupError) as err:
                await rs.connect(startup_timeout_s=5)
            assert all(w in str(err.value) for w in words), str(err.value)
            await rs.close()
        rs = RankSet(["127.0.0.1:1"])
        with pytest.raises(StartupError, match="rank0 at 127.0.0.1:1"):
            await rs.connect(startup_timeout_s=0.5)
        await rs.close()
        await r0.stop()
        await r1.stop()
    run(body())


async def _restart(c, i: int, **kw) -> None:
    """Replace stand-in rank i by a new process-alike on the same port (a new instance id)."""
    old = c.ranks[i]
    await old.stop()
    new = StandinRank(rank=i, world=old.world, port=int(old.address.rsplit(":", 1)[1]), **kw)
    await new.start()
    c.ranks[i] = new


def test_restarted_rank_group_is_served_again_from_empty_caches():
    """After a rank failure the scheduler waits for the whole group to come back as new processes, then serves again
    with a fresh pool and prefix index (the new ranks' caches are empty: reusing old blocks or snapshots would make
    the stand-in refuse to read positions it never wrote)."""
    async def body():
        prompt = [7] * 70  # long enough for a prefix snapshot (at position 64)
        async with cluster(2, rank=dict(step_delay_s=0.002), per_rank=[{}, {"fail_at_round": 8}]) as c:
            warm = await generate(c, prompt, 3, rid="warm")
            assert warm.tokens == standin_generate(prompt, 3, vocab=VOCAB)[0]
            failed = await generate(c, [1, 2, 3], 50, rid="dies")
            assert failed.reason == "error" and "rank1" in failed.finished.error

            await _restart(c, 1)  # half a new group is not trusted: rank0 still holds the old caches
            await asyncio.sleep(2.5)  # more than two probes
            h = await c.health()
            comps = {x.name: x for x in h.components}
            assert not h.healthy and comps["rank1"].alive and "restarted" in comps["rank1"].detail
            assert "waiting for the rank group to restart" in comps["scheduler"].detail
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c, [1, 2], 3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "waiting for the rank group" in err.value.details()

            await _restart(c, 0)

            async def healthy() -> bool:
                return (await c.health()).healthy
            await wait_until(healthy, timeout_s=10, every_s=0.1)
            again = await generate(c, prompt, 3, rid="warm-again")
            assert again.reason == "length" and again.tokens == warm.tokens
            assert again.finished.cached_tokens == 0  # the old prefix index went with the old caches
            assert c.ranks[0].rounds[0].round == 1  # the new group's streams start from round 1
            assert not c.standin_errors()
    run(body())


def test_rank_group_back_with_other_settings_stays_unavailable():
    async def body():
        async with cluster(2, per_rank=[{}, {"fail_at_round": 2}]) as c:
            assert (await generate(c, [1, 2, 3], 5)).reason == "error"
            for i in (0, 1):
                await _restart(c, i, fingerprint="other")

            async def says_settings_changed() -> bool:
                return "other settings" in {x.name: x for x in (await c.health()).components}["scheduler"].detail
            await wait_until(says_settings_changed, timeout_s=10, every_s=0.1)
            h = await c.health()
            assert not h.healthy and not {x.name: x for x in h.components}["scheduler"].alive
            assert "restart the scheduler" in {x.name: x for x in h.components}["scheduler"].detail
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c, [1, 2], 3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "other settings" in err.value.details()
    run(body())


def test_rounds_overlap_without_drafts_and_replies_stay_exact():
    """With no drafter and no grammar the scheduler sends round n+1 while the ranks compute round n (its decode rows
    carry a pending token id the ranks fill in): the stand-in sees it, and the replies equal the reference."""
    async def body():
        async with cluster(1, rank=dict(step_delay_s=0.005)) as c:
            prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
            replies = await asyncio.gather(*(generate(c, p, 30, rid=f"o{i}") for i, p in enumerate(prompts)))
            for p, r in zip(prompts, replies):
                assert r.tokens == standin_generate(p, 30, vocab=VOCAB, seed=derive_seed(p))[0]
            assert c.ranks[0].pending_filled >= 40  # most decode rows were planned a round ahead
            await wait_until(lambda: _pool_empty_async(c))
            assert not c.standin_errors()
    run(body())


def test_penalised_rows_carry_their_history_and_only_output_penalties_stop_the_overlap():
    """Each sample row of a frequency-penalised request carries the counts of the tokens generated before it, and
    its rounds are not planned ahead (they need the last token); logit_bias and min_tokens rows (which need only
    counts the scheduler has) stay overlapped, and min_tokens bans the stop ids for exactly its first rows."""
    def seen(pen: rank_pb2.RowPenalties) -> dict[int, int]:
        return {t: c for t, c in zip(from_proto(pen.seen_ids)[0].tolist(), from_proto(pen.seen_counts)[0].tolist())
                if t >= 0}

    async def body():
        async with cluster(1, rank=dict(step_delay_s=0.005)) as c:
            rank = c.ranks[0]
            prompt = [3, 1, 4, 1, 5]
            sampling = generate_pb2.Sampling(temperature=0.0, top_p=1.0, frequency_penalty=1.0)
            reply = await collect(c.stub.Generate(generate_pb2.GenerateRequest(
                request_id="f", prompt_ids=to_proto(prompt), sampling=sampling, max_tokens=12), timeout=20))
            assert rank.pending_filled == 0 and len(rank.penalties) == 12
            for i, pen in enumerate(rank.penalties):  # row i follows reply[:i]; no prompt ids (repetition is off)
                assert seen(pen) == dict(collections.Counter(reply.tokens[:i])), i
            rank.penalties.clear()
            sampling = generate_pb2.Sampling(temperature=0.0, top_p=1.0, logit_bias={7: 2.5})
            await collect(c.stub.Generate(generate_pb2.GenerateRequest(
                request_id="b", prompt_ids=to_proto(prompt), sampling=sampling, max_tokens=30, min_tokens=4,
                stop_token_ids=[999], ignore_eos=True), timeout=20))
            assert rank.pending_filled >= 10  # still planned a round ahead
            banned = [from_proto(p.banned_ids)[0].tolist() for p in rank.penalties]
            assert banned[:4] == [[999]] * 4 and all(b == [] for b in banned[4:])
            assert all(from_proto(p.bias_ids).tolist() == [[7]] and not seen(p) for p in rank.penalties)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(c.stub.Generate(generate_pb2.GenerateRequest(
                    prompt_ids=to_proto(prompt), max_tokens=4,
                    sampling=generate_pb2.Sampling(presence_penalty=2.5)), timeout=20))
            assert err.value.details().startswith("invalid_penalties: presence_penalty")
            await wait_until(lambda: _pool_empty_async(c))
            assert not c.standin_errors()
    run(body())
