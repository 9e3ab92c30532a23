"""Reading a torch.profiler Chrome trace (the rank profiler's rank<R>-rounds.json, or any trace torch exports): its
GPU events, the time they cover, and what the tensor-parallel collective's kernels cost in it. bench.trace_gaps
reports a whole trace; bench.whole_model puts the collectives' share in its table."""

from __future__ import annotations

import json
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# The tensor-parallel collective's kernels: the same-host CUDA exchange's (model/device_exchange.py) and NCCL's.
COLLECTIVE_KERNELS = ("_exchange_kernel", "nccl")


def load_events(path: Path) -> list[dict]:
    """A Chrome trace's events (torch writes {"traceEvents": [...]}; a bare list is accepted too)."""
    data = json.loads(path.read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, sorted."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def covered_us(events: list[dict]) -> float:
    """The time at least one of `events` runs (the union of their intervals)."""
    return sum(e - s for s, e in merged([(e["ts"], e["ts"] + e["dur"]) for e in events]))


def gpu_events(events: list[dict]) -> list[dict]:
    """The trace's complete GPU events: kernels, copies, memsets."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]


def trace_collectives(path: Path) -> dict | None:
    """`collective_figures` of a trace file."""
    gpu = gpu_events(load_events(path))
    return collective_figures(gpu, covered_us(gpu))


def collective_figures(gpu: list[dict], busy_us: float) -> dict | None:
    """The collective's share of GPU busy time `busy_us`, from the GPU events `gpu`, or None when it ran none
    (TP 1). A collective kernel's time is the transfer plus the wait for the peers to arrive. The transfer is taken
    as every call lasting as long as the fastest one; the rest is waiting, told apart by where it falls: at the
    first collective of a CUDA graph launch (the kernels of one launch share its correlation id; an eager call is
    its own) it is the skew between the ranks' launches, at the others a peer still computing its share of the
    step."""
    calls = [e for e in gpu if any(c in e["name"] for c in COLLECTIVE_KERNELS)]
    if not calls:
        return None
    coll_us = covered_us(calls)
    floor = min(e["dur"] for e in calls)
    first: dict[object, dict] = {}
    for i, e in enumerate(sorted(calls, key=lambda e: e["ts"])):
        first.setdefault(e.get("args", {}).get("correlation", ("eager", i)), e)
    skew = sum(e["dur"] - floor for e in first.values())
    return {"ms": coll_us / 1e3, "share": coll_us / busy_us, "calls": len(calls), "fastest_us": floor,
            "transfer_ms": floor * len(calls) / 1e3, "transfer_share": floor * len(calls) / busy_us,
            "skew_ms": skew / 1e3, "wait_ms": (sum(e["dur"] for e in calls) - floor * len(calls) - skew) / 1e3}
