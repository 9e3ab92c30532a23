"""The Step stream's plans, read ahead by a thread, so the rank can ask "is the next plan here yet?" without blocking.

gRPC hands a streaming call's requests to the handler as a blocking iterator. The rank wants to queue round n+1 on
the GPU while round n still runs, but only if plan n+1 has already arrived — otherwise it should read round n back
and answer it at once. A reader thread moves the plans into a queue; `next` waits for whichever comes first: a plan,
or a condition the caller polls (round n's GPU work being done).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Final

from twinspark.v1 import rank_pb2

# How often `next` looks at the caller's condition while no plan is there: short against a decode step (~1 ms and
# up), long enough not to spin a core.
POLL_S: Final = 5e-5

END: Final = object()  # the stream ended (the scheduler closed it, or the call was cancelled)
NOT_YET: Final = object()  # the caller's condition came true before a plan arrived


class PlanQueue:
    def __init__(self, plans: Iterator[rank_pb2.StepPlan]) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(plans,), name="step-plans", daemon=True)
        self._thread.start()

    def _read(self, plans: Iterator[rank_pb2.StepPlan]) -> None:
        try:
            for plan in plans:
                self._queue.put(plan)
        except Exception:  # noqa: BLE001 — a cancelled call ends the iterator with an error: the stream is over
            pass
        finally:
            self._queue.put(END)

    def next(self, until: Callable[[], bool] | None = None) -> object:
        """The next plan, END, or (with `until`) NOT_YET once `until()` is true and no plan is waiting."""
        if until is None:
            return self._queue.get()
        while True:
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if until():
                    try:  # one that came in meanwhile still goes first
                        return self._queue.get_nowait()
                    except queue.Empty:
                        return NOT_YET
