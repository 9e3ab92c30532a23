"""The scheduler's client to the drafter: one Propose per decode round, never allowed to hold serving up; and
`DraftRows`, the target layers' outputs a request's DFlash drafts still need delivered.

A Propose that fails or takes longer than `timeout_s` marks the drafter down: that round (and every round until
`retry_s` has passed) runs without drafts, and Health names the drafter as down (serving itself stays healthy —
drafts are an optimisation). The next attempt after `retry_s` brings it back when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch
from opentelemetry import trace

from services.common.internal_auth import aio_channel
from services.common.tensors import ids, to_proto
from twinspark.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("twinspark.scheduler.drafts")


# What one request's undelivered context rows may hold (a drafter down for long, a long prompt prefilled before
# its first Propose); beyond it the oldest rows are dropped and the drafter starts its context after them.
MAX_PENDING_BYTES = 1 << 30
# Context rows one Propose carries, all requests together (the drafter takes messages up to 256 MiB); the rest go
# in the next rounds' calls, and a request drafts again once its context reaches its last token.
PROPOSE_ROW_BYTES = 64 << 20


class DraftRows:
    """A request's context rows (the target layers' outputs by absolute position, `StepPlan.hidden_layers`) that
    the ranks computed and the drafter has not been sent yet. Rows arrive in position order; after a gap (positions
    the ranks did not compute, such as a prompt resumed from the prefix cache) the rows before it are useless to the
    drafter, which keeps contiguous context only, so they are dropped."""

    def __init__(self) -> None:
        self.start = 0  # the absolute position of the first pending row
        self._rows: list[torch.Tensor] = []
        self._count = 0
        self._bytes = 0

    def add(self, start: int, rows: torch.Tensor) -> None:
        if self._rows and start != self.start + self._count:
            self._rows, self._count, self._bytes = [], 0, 0
        if not self._rows:
            self.start = start
        self._rows.append(rows)
        self._count += rows.shape[0]
        self._bytes += rows.numel() * rows.element_size()
        while self._bytes > MAX_PENDING_BYTES and len(self._rows) > 1:
            old = self._rows.pop(0)
            self.start += old.shape[0]
            self._count -= old.shape[0]
            self._bytes -= old.numel() * old.element_size()

    def _joined(self) -> torch.Tensor | None:
        if len(self._rows) > 1:
            self._rows = [torch.cat(self._rows)]
        return self._rows[0] if self._rows else None

    def pending(self, max_bytes: int) -> torch.Tensor | None:
        """The first pending rows [n, width] that fit `max_bytes`, or None when there are none (or none fit)."""
        rows = self._joined()
        if rows is None:
            return None
        n = min(rows.shape[0], max_bytes // max(1, rows[0].numel() * rows.element_size()))
        return rows[:n] if n else None

    def delivered(self, n: int) -> None:
        """The drafter took the first `n` pending rows."""
        rows = self._joined()
        if rows is None:
            return
        rest = rows[n:].clone()  # a copy: the delivered rows' memory goes
        self.start += n
        self._rows = [rest] if rest.shape[0] else []
        self._count = rest.shape[0]
        self._bytes = rest.numel() * rest.element_size()


class DrafterClient:
    def __init__(self, address: str, *, timeout_s: float = 0.5, retry_s: float = 2.0, token: str | None = None
                 ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.channel = aio_channel(address, token, [("grpc.max_send_message_length", 256 << 20)])
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.alive = True  # until a call says otherwise
        self.detail = address
        self._retry_at = 0.0
        self.calls = 0
        self.failures = 0

    @property
    def usable(self) -> bool:
        return self.alive or time.monotonic() >= self._retry_at

    async def propose(self, seqs: list[tuple[str, list[int], int, torch.Tensor | None, int]],
                      metadata: tuple[tuple[str, str], ...] = ()) -> list[list[int]] | None:
        """seqs: (request id, tokens, max drafts, hidden or None, position of hidden's first row: DFlash context
        rows); `metadata` goes with the call (trace context). Drafts per sequence, or None when the drafter is down /
        slow (the round then runs without drafts)."""
        if not seqs or not self.usable:
            return None
        msg = drafter_pb2.ProposeRequest(sequences=[
            drafter_pb2.DraftSequence(request_id=rid, tokens=to_proto(toks), max_draft=k,
                                      hidden=to_proto(h, "float32") if h is not None else None, hidden_start=at)
            for rid, toks, k, h, at in seqs])
        self.calls += 1
        try:
            reply = await self.stub.Propose(msg, timeout=self.timeout_s, metadata=metadata or None)
            drafts = [ids(d) for d in reply.drafts]
            if len(drafts) != len(seqs):
                raise ValueError(f"{len(drafts)} draft lists for {len(seqs)} sequences")
        except (grpc.aio.AioRpcError, ValueError, asyncio.TimeoutError) as exc:
            self.failures += 1
            text = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if self.alive:
                log.warning("drafter at %s failed (%s): going on without drafts, retrying every %.1f s",
                            self.address, text, self.retry_s)
            self.alive = False
            self.detail = f"{self.address}: {text}"
            self._retry_at = time.monotonic() + self.retry_s
            # The caller's Propose span is current (a no-op one when tracing is off): mark it failed.
            trace.get_current_span().set_status(trace.StatusCode.ERROR, text)
            return None
        if not self.alive:
            log.info("drafter at %s is back", self.address)
        self.alive = True
        self.detail = self.address
        return [d[:k] for d, (_, _, k, _, _) in zip(drafts, seqs)]

    async def close(self) -> None:
        await self.channel.close()
