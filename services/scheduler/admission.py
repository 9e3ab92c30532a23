"""The bounded waiting queue: who gets admitted next, and how long a refused client should wait.

Two classes, each FCFS: every PRIORITY_NORMAL request is admitted before any PRIORITY_BACKGROUND one. Admission is
strictly in order — when the head does not fit the pool yet, nobody behind it jumps ahead — so a large request
cannot be starved by a stream of small ones, and background work never overtakes normal work.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterator

from services.scheduler.request import Request
from twinspark.v1 import generate_pb2


class QueueFull(RuntimeError):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the waiting queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class AdmissionQueue:
    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_waiting = max_waiting
        self._normal: deque[Request] = deque()
        self._background: deque[Request] = deque()
        # Seconds a request spends running, smoothed; seeds the Retry-After estimate. Starts at one second.
        self._service_s = 1.0

    def __len__(self) -> int:
        return len(self._normal) + len(self._background)

    def __iter__(self) -> Iterator[Request]:
        yield from self._normal
        yield from self._background

    def _lane(self, req: Request) -> deque[Request]:
        return self._background if req.priority == generate_pb2.PRIORITY_BACKGROUND else self._normal

    def push(self, req: Request, *, capacity: int, force: bool = False) -> None:
        """Queue `req`, or raise QueueFull with a Retry-After estimate (`capacity` = how many can run at once).

        `force` skips the bound, for a request that is about to be admitted at once (it never really waits)."""
        if not force and len(self) >= self.max_waiting:
            raise QueueFull(self.retry_after(capacity))
        self._lane(req).append(req)

    def push_front(self, req: Request) -> None:
        """Put an admitted request back at the head of its class (its KV tier load failed: it is planned again)."""
        self._lane(req).appendleft(req)

    def head(self) -> Request | None:
        """The next request to admit: the oldest normal one, else the oldest background one."""
        if self._normal:
            return self._normal[0]
        return self._background[0] if self._background else None

    def pop_head(self) -> Request:
        return self._normal.popleft() if self._normal else self._background.popleft()

    def remove(self, req: Request) -> bool:
        lane = self._lane(req)
        try:
            lane.remove(req)
        except ValueError:
            return False
        return True

    def drain(self) -> list[Request]:
        out = list(self)
        self._normal.clear()
        self._background.clear()
        return out

    # -- Retry-After ----------------------------------------------------------------------------------------------
    def record_service(self, seconds: float) -> None:
        """Feed the time one finished request spent running (exponential moving average, weight 0.2)."""
        self._service_s = 0.8 * self._service_s + 0.2 * max(0.0, seconds)

    def retry_after(self, capacity: int) -> int:
        """Whole seconds until a queue slot is likely free: the queue ahead drains `capacity` requests per
        service time. At least 1 (HTTP Retry-After has no fractions), at most 10 minutes."""
        waves = (len(self) + 1) / max(1, capacity)
        return int(min(600, max(1, math.ceil(waves * self._service_s))))
