"""gRPC clients to every rank worker: Describe at start, one bidirectional Step stream per rank, lock-step rounds.

Every round the same sealed StepPlan goes to every rank (they meet in the collective, so a rank left out would hang
its peers); every rank must answer that round without error. Rank 0's sampled ids are the result. The first rank
that fails (stream broken, error answer, wrong round, timeout) is recorded and the whole set is failed from then on:
the ranks' caches can no longer be trusted to agree, and a restarted group must begin from round 1 anyway.

Recovery (`wait_for_new_group`, run by the engine after a failure): the ranks' watchdog makes the whole group exit and
the supervisor restarts it. Describe is probed until every rank answers as a new process (an `instance_id` other
than the one it had when the set was connected: a half-old group cannot be trusted) with the fingerprint the
scheduler started with; then the Step streams are opened again from round 1. Ranks that come back with other
settings leave the set unusable (`stuck`): the scheduler was sized for the old ones and must be restarted.

What the group's Describe replies say about the model and cache (`ModelInfo`) lives in model_info.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from services.common.internal_auth import aio_channel
from services.common.plan_checksum import seal
from services.scheduler.model_info import ModelInfo, describe_differences
from services.scheduler.round_output import RoundOutput, decode
from twinspark.v1 import rank_pb2, rank_pb2_grpc

log = logging.getLogger("twinspark.scheduler.ranks")

# Received: up to 1 GiB, a round's DFlash layer rows (rank_worker/server.py says how big they get).
_CHANNEL_OPTS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 256 << 20),
                 # Reconnect to a restarted rank within ~a second, not after gRPC's backoff (up to 120 s) has grown.
                 ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 1000)]
PROBE_INTERVAL_S = 1.0  # Describe cadence while waiting for a failed group to come back


class StartupError(RuntimeError):
    """The ranks cannot be served together (unreachable, mismatched fingerprints, wrong order)."""


class PlanRefused(RuntimeError):
    """Every rank refused this round's plan as malformed before running anything (StepResult.refused): the ranks
    are still in lock-step, so only the round's requests fail. A scheduler bug, never a rank failure."""


@dataclass
class Round:
    """A submitted round: its sealed plan and each rank's pending answer."""
    plan: rank_pb2.StepPlan
    reads: list[asyncio.Future]


class RankError(RuntimeError):
    def __init__(self, index: int, address: str, reason: str) -> None:
        super().__init__(f"rank{index} ({address}): {reason}")
        self.index = index
        self.address = address
        self.reason = reason

    @property
    def public(self) -> str:
        """The failure without internal addresses (it reaches HTTP clients through the gateway)."""
        return f"rank{self.index} failed: {self.reason}"


class _Refused(str):
    """One rank's answer refusing a malformed plan (it keeps serving); see PlanRefused."""


def _rpc_error_text(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class RankClient:
    def __init__(self, index: int, address: str, token: str | None = None) -> None:
        self.index = index
        self.address = address
        self.name = f"rank{index}"
        self.channel = aio_channel(address, token, _CHANNEL_OPTS)
        self.stub = rank_pb2_grpc.RankWorkerStub(self.channel)
        self.call: grpc.aio.StreamStreamCall | None = None

    async def describe(self, timeout: float) -> rank_pb2.DescribeReply:
        return await self.stub.Describe(rank_pb2.DescribeRequest(), timeout=timeout)


class RankSet:
    def __init__(self, addresses: list[str], *, rank_timeout_s: float | None = 300.0,
                 token: str | None = None) -> None:
        if not addresses:
            raise ValueError("at least one rank address is needed")
        self.clients = [RankClient(i, a.strip(), token) for i, a in enumerate(addresses)]
        self.rank_timeout_s = rank_timeout_s
        self.info: ModelInfo | None = None
        self.described: list[rank_pb2.DescribeReply] = []  # the connected group's Describe replies, in rank order
        self.failure: RankError | None = None  # the first failure; set until a restarted group is reopened
        self.stuck: str | None = None  # why a failed set can never be reopened (the ranks came back changed)
        self.on_failure: Callable[[RankError], None] | None = None  # the engine's wake-up hook
        self._round = 0
        self.tier_listing: list[rank_pb2.TierEntry] = []  # disk tier entries every rank of the group holds
        self._closing = False
        self._in_flight = 0  # rounds submitted and not yet collected
        self._last_read: list[asyncio.Future | None] = []  # per client: the read of the newest submitted round

    # -- startup --------------------------------------------------------------------------------------------------
    async def connect(self, startup_timeout_s: float = 120.0) -> ModelInfo:
        """Describe every rank until all answer (or the timeout), check they form one group, open Step streams."""
        deadline = time.monotonic() + startup_timeout_s
        replies: list[rank_pb2.DescribeReply | None] = [None] * len(self.clients)
        last_error: dict[int, str] = {}
        next_log = 0.0
        while True:
            for c in self.clients:
                if replies[c.index] is not None:
                    continue
                try:
                    replies[c.index] = await c.describe(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                    log.info("%s at %s answered: model %s, rank %d of %d, fingerprint %s…", c.name, c.address,
                             replies[c.index].model, replies[c.index].rank, replies[c.index].world,
                             replies[c.index].fingerprint[:12])
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # waiting will not change it
                        raise StartupError(f"{c.name} at {c.address} refused the scheduler's internal token: start "
                                           "every role with the same --internal-token") from None
                    last_error[c.index] = _rpc_error_text(exc)
            missing = [c for c in self.clients if replies[c.index] is None]
            if not missing:
                break
            now = time.monotonic()
            if now >= deadline:
                raise StartupError("ranks did not answer Describe within %.0f s: %s" % (startup_timeout_s, "; ".join(
                    f"{c.name} at {c.address} ({last_error.get(c.index, 'no answer')})" for c in missing)))
            if now >= next_log:
                log.info("waiting for %s", ", ".join(f"{c.name} at {c.address}" for c in missing))
                next_log = now + 5.0
            await asyncio.sleep(0.5)
        got = [r for r in replies if r is not None]
        self._check_group(got)
        self.info = ModelInfo.from_describe(got[0], got)
        self.described = got
        await self._list_tiers()
        self._open_streams()
        log.info("serving %s with %d rank(s): %d blocks x %d tokens, %d slots, vocab %d, window %d, eos %s",
                 self.info.model, len(self.clients), self.info.num_blocks, self.info.block_size, self.info.num_slots,
                 self.info.vocab_size, self.info.max_model_len, list(self.info.eos_ids))
        return self.info

    async def _list_tiers(self) -> None:
        """The disk tier entries every rank holds (a rank that lost one, or never wrote it, rules it out)."""
        self.tier_listing = []
        if self.info is None or self.info.tier_disk_bytes <= 0:
            return
        replies = await asyncio.gather(*(c.stub.TierList(rank_pb2.TierListRequest(), timeout=60)
                                         for c in self.clients))
        common = set.intersection(*({e.key for e in r.entries} for r in replies))
        self.tier_listing = [e for e in replies[0].entries if e.key in common]
        log.info("disk kv tier: %d entries held by every rank", len(self.tier_listing))

    def _check_group(self, replies: list[rank_pb2.DescribeReply]) -> None:
        n = len(self.clients)
        wrong = [f"{c.name} at {c.address} says it is rank {r.rank} of {r.world}"
                 for c, r in zip(self.clients, replies) if r.rank != c.index or r.world != n]
        if wrong:
            raise StartupError(f"--ranks must list the {n} ranks of one group in rank order: " + "; ".join(wrong))
        base = replies[0]
        differ = [(c, r) for c, r in zip(self.clients, replies) if r.fingerprint != base.fingerprint]
        if differ:
            raise StartupError("rank fingerprints differ, refusing to start: " + "; ".join(
                f"{c.name} at {c.address} ({describe_differences('rank0', base, c.name, r)})" for c, r in differ))
        if base.num_blocks < 1 or base.block_size < 1 or base.num_slots < 1 or base.vocab_size < 1 \
                or base.max_model_len < 1:
            raise StartupError(f"rank0 describes an unusable cache/model: {base}")

    def _open_streams(self) -> None:
        """A Step stream per rank, from round 1."""
        self._round = 0
        self._in_flight = 0
        self._last_read = [None] * len(self.clients)
        for c in self.clients:
            self._open_stream(c)

    def _open_stream(self, c: RankClient) -> None:
        c.call = c.stub.Step()

        def ended(call: grpc.aio.StreamStreamCall, c: RankClient = c) -> None:
            # A stream that ends between rounds means the rank went away; during a round the exchange itself sees
            # the end and reports the rank's own error text, which is the better message.
            if not self._closing and not self._in_flight:
                asyncio.ensure_future(self._note_stream_end(c, call))

        c.call.add_done_callback(ended)

    async def _note_stream_end(self, c: RankClient, call: grpc.aio.StreamStreamCall) -> None:
        try:
            reason = f"Step stream ended ({(await call.code()).name}: {await call.details()})"
        except Exception as exc:  # noqa: BLE001 — only for the message
            reason = f"Step stream ended ({exc})"
        if c.call is call:  # not the stream of a group already given up on (recovery cancels those)
            self._fail(RankError(c.index, c.address, reason))

    def _fail(self, err: RankError) -> None:
        if self.failure is not None or self._closing:
            return
        self.failure = err
        log.error("rank failure: %s — failing in-flight requests; unavailable until the rank group has restarted",
                  err)
        if self.on_failure is not None:
            self.on_failure(err)

    # -- rounds ---------------------------------------------------------------------------------------------------
    async def step(self, plan: rank_pb2.StepPlan) -> RoundOutput:
        """Run one round on every rank; its output. Raises RankError (and the set is dead) on failure."""
        return await self.collect(await self.submit(plan))

    async def submit(self, plan: rank_pb2.StepPlan) -> "Round":
        """Send one round's plan to every rank without waiting for its result (`collect` does). Rounds may be
        submitted while earlier ones are in flight: every stream carries them in order, and their results come
        back in order."""
        if self.failure is not None:
            raise self.failure
        self._round += 1
        plan.round = self._round
        seal(plan)
        self._in_flight += 1
        try:
            await asyncio.gather(*(self._write(c, plan) for c in self.clients))
        except RankError as err:
            self._in_flight -= 1
            # A stream that broke under this write may have answered an earlier round with the reason: prefer it.
            prev = self._last_read[err.index]
            if prev is not None:
                await asyncio.wait([prev], timeout=self.rank_timeout_s)
                if prev.done() and not prev.cancelled() and isinstance(prev.exception(), RankError):
                    err = prev.exception()
            self._fail(err)
            raise self.failure or err
        reads = []
        for i, c in enumerate(self.clients):
            reads.append(asyncio.ensure_future(self._read(c, plan, self._last_read[i])))
            # A round given up on after a failure is never collected: its reads' errors are known already.
            reads[-1].add_done_callback(lambda t: t.cancelled() or t.exception())
            self._last_read[i] = reads[-1]
        return Round(plan, reads)

    async def collect(self, rnd: "Round") -> RoundOutput:
        """Wait for a submitted round's answers (in submission order): rank 0's output, with the tier entries any
        rank found bad. Raises RankError (the set is dead) or PlanRefused."""
        plan, tasks = rnd.plan, rnd.reads
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.rank_timeout_s,
                                               return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        finally:
            self._in_flight -= 1
        for t in tasks:  # the first error wins; a rank that never answered is named too
            if t in done and t.exception() is not None:
                for p in pending:
                    p.cancel()
                err = t.exception()
                if not isinstance(err, RankError):
                    c = self.clients[tasks.index(t)]
                    err = RankError(c.index, c.address, _rpc_error_text(err))
                self._fail(err)
                raise self.failure or err
        if pending:
            for p in pending:
                p.cancel()
            c = self.clients[tasks.index(next(iter(pending)))]
            self._fail(RankError(c.index, c.address, f"no answer to round {plan.round} within {self.rank_timeout_s} s"))
            raise self.failure  # type: ignore[misc]
        results = [t.result() for t in tasks]
        refused = [(c, r) for c, r in zip(self.clients, results) if isinstance(r, _Refused)]
        if refused and len(refused) == len(results):
            raise PlanRefused(f"round {plan.round}: every rank refused the plan: {refused[0][1]}")
        if refused:  # some ranks ran a plan the others refused: they no longer agree
            c, r = refused[0]
            self._fail(RankError(c.index, c.address, f"round {plan.round}: refused a plan its peers ran: {r}"))
            raise self.failure  # type: ignore[misc]
        first = results[0]
        for c, r in zip(self.clients[1:], results[1:]):
            if r.sampled and r.sampled != first.sampled:  # ranks must hold the same bits (docs/design.md §5.3); say so
                log.error("round %d: %s sampled %s but rank0 sampled %s (rank invariance broken)", plan.round,
                          c.name, r.sampled, first.sampled)
        first.tier_bad = sorted(set().union(*(r.tier_bad for r in results)))
        return first

    def abandon(self, rnd: "Round") -> None:
        """Drop a submitted round that will never be collected (its ranks failed): stop waiting for its answers."""
        self._in_flight -= 1
        for t in rnd.reads:
            t.cancel()

    async def _write(self, c: RankClient, plan: rank_pb2.StepPlan) -> None:
        assert c.call is not None
        try:
            await c.call.write(plan)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise RankError(c.index, c.address, f"round {plan.round}: {_rpc_error_text(exc)}") from exc

    async def _read(self, c: RankClient, plan: rank_pb2.StepPlan,
                    after: asyncio.Future | None) -> "RoundOutput | _Refused":
        assert c.call is not None
        if after is not None:  # the previous round's answer comes first on this stream
            await asyncio.wait([after])
            earlier = None if after.cancelled() else after.exception()
            if isinstance(earlier, RankError):  # the stream broke there: that is the reason for this round too
                raise earlier
            if self.failure is not None:
                raise RankError(c.index, c.address, f"round {plan.round}: not read, an earlier round failed")
        try:
            res = await c.call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise RankError(c.index, c.address, f"round {plan.round}: {_rpc_error_text(exc)}") from exc
        if res is grpc.aio.EOF:
            raise RankError(c.index, c.address, f"round {plan.round}: the Step stream closed without an answer")
        if res.error:
            if res.refused:
                return _Refused(res.error)
            raise RankError(c.index, c.address, f"round {plan.round}: {res.error}")
        if res.round != plan.round:
            raise RankError(c.index, c.address, f"answered round {res.round} to round {plan.round}")
        try:  # rank 0's answer carries the round's extras (every rank computes the same)
            return decode(plan, res, full=c.index == 0)
        except ValueError as exc:
            raise RankError(c.index, c.address, f"round {plan.round}: bad answer: {exc}") from exc

    # -- recovery -------------------------------------------------------------------------------------------------
    def _is_new(self, c: RankClient, d: rank_pb2.DescribeReply) -> bool:
        """Is this another process than the one the set was connected to? (A rank that reports no instance id cannot
        be told apart from its old self: never.)"""
        return bool(d.instance_id) and d.instance_id != self.described[c.index].instance_id

    async def _probe(self, c: RankClient) -> rank_pb2.DescribeReply | None:
        try:
            return await c.describe(timeout=PROBE_INTERVAL_S)
        except grpc.aio.AioRpcError:
            return None

    async def wait_for_new_group(self) -> bool:
        """After a failure: probe Describe every PROBE_INTERVAL_S until every rank answers as a new process, then
        check the new group and open its Step streams from round 1, clearing the failure (True). A group that came
        back with other settings sets `stuck` (False): the scheduler was sized for the old one."""
        assert self.failure is not None and self.info is not None
        t0 = time.monotonic()
        next_log = t0 + 10.0
        while True:
            replies = await asyncio.gather(*(self._probe(c) for c in self.clients))
            waiting = [f"{c.name} ({'unreachable' if d is None else 'not restarted yet'})"
                       for c, d in zip(self.clients, replies) if d is None or not self._is_new(c, d)]
            if not waiting:
                break
            if time.monotonic() >= next_log:
                log.info("waiting %.0f s for the rank group to restart: %s", time.monotonic() - t0, ", ".join(waiting))
                next_log += 10.0
            await asyncio.sleep(PROBE_INTERVAL_S)
        group: list[rank_pb2.DescribeReply] = [d for d in replies if d is not None]
        try:
            self._check_group(group)
            if group[0].fingerprint != self.info.fingerprint:
                raise StartupError(describe_differences("before", self.described[0], "now", group[0]))
        except StartupError as exc:
            self.stuck = (f"the ranks came back with other settings than the scheduler started with ({exc}); "
                          f"restart the scheduler")
            log.error("%s", self.stuck)
            return False
        for c in self.clients:
            if c.call is not None:
                c.call.cancel()  # the failed group's streams (normally over already)
        self.described = group
        try:
            await self._list_tiers()
        except grpc.aio.AioRpcError as exc:  # the group is up; its disk tier is only a cache
            log.warning("could not list the disk kv tier after the restart: %s", _rpc_error_text(exc))
            self.tier_listing = []
        self._open_streams()
        failed, self.failure = self.failure, None
        log.info("the rank group restarted after %.1f s (instances %s): serving again from round 1; the failure was "
                 "%s", time.monotonic() - t0, ", ".join(d.instance_id[:8] for d in group), failed)
        return True

    # -- liveness -------------------------------------------------------------------------------------------------
    async def ping(self, timeout_s: float = 1.0) -> list[tuple[str, bool, str]]:
        """(name, alive, detail) per rank: answers Describe with our fingerprint, and is not the rank that failed
        (unless it has restarted since). While the set is failed the details say what recovery waits for."""
        async def one(c: RankClient) -> tuple[str, bool, str]:
            try:
                d = await c.describe(timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                return c.name, False, f"{c.address}: unreachable (Describe: {_rpc_error_text(exc)})"
            if self.info is not None and d.fingerprint != self.info.fingerprint:
                return c.name, False, f"{c.address}: fingerprint changed (restarted with other settings?)"
            if self.failure is None:
                return c.name, True, c.address
            if self._is_new(c, d):
                return c.name, True, f"{c.address}: restarted, waiting for the rest of the group"
            if self.failure.index == c.index:
                return c.name, False, f"{c.address}: failed: {self.failure.reason}"
            return c.name, True, f"{c.address}: answering, but its group failed: waiting for the group to restart"
        return list(await asyncio.gather(*(one(c) for c in self.clients)))

    async def close(self) -> None:
        self._closing = True
        for c in self.clients:
            if c.call is not None:
                c.call.cancel()
            await c.channel.close()
