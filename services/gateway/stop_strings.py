"""Stop strings matched across chunk boundaries.

Text arrives in pieces (one per token), and a stop string may straddle several. We hold back the longest tail of
the text seen so far that could still be the start of a stop string, and release it only once it cannot be:
so every occurrence is found, and no text that belongs to (or follows) a stop string is ever sent to a client.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopHit:
    stop: str    # which stop string matched
    text: str    # the text to emit before stopping (up to the stop string, or through it when included)


class StopStringMatcher:
    def __init__(self, stops: list[str], include_stop_str: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]  # de-duplicated, empty strings mean nothing
        self._include = include_stop_str
        self._held = ""
        self.hit: StopHit | None = None

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> str:
        """Add text; return what can be emitted now. After a hit (see `hit`) nothing more is accepted."""
        if self.hit is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        # Of the stops completed by this piece, the earliest-starting one wins (the least text before it); among
        # stops starting at the same place, the longest.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or (pos, -len(stop)) < (best[0], -best[1])):
                best = (pos, len(stop), stop)
        if best is not None:
            pos, length, stop = best
            out = buf[: pos + length] if self._include else buf[:pos]
            self._held = ""
            self.hit = StopHit(stop=stop, text=out)
            return out
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of output: the held tail could not become a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.hit is not None else out

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
