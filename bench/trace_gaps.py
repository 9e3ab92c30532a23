"""Where a profiled window's GPU time went: busy vs idle, and the idle gaps by size, from a torch.profiler Chrome
trace (the rank profiler's rank<R>-rounds.json, or any trace torch exports).

torch's operator tables sum kernel times; they cannot say how long the GPU sat idle between them, which is what a
served step loses to the host (plan checks, graph launches, reading back, the gRPC hop). This reads the kernel and
memcpy events of the trace, merges their intervals, and prints:
- the window, the GPU-busy time and the idle time (both also per CUDA graph launch, i.e. per decode round), and
  the time in the tensor-parallel collective's kernels (the CUDA exchange's or NCCL's) where there are any, split
  into the transfer and the wait for a peer (at a launch's first call: the ranks' launch skew);
- the idle gaps bucketed by length (most of a host-bound step is a few long gaps, a launch-bound one many short);
- the host calls that take the most CPU time (cudaGraphLaunch, synchronizes, copies);
- the kernels by GPU time with their call counts per round.

    python -m bench.trace_gaps /tmp/prof/rank0-rounds.json
    python -m bench.trace_gaps TRACE --out bench/results/trace-<name>.md
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from bench import flags
from bench.chrome_trace import collective_figures, gpu_events, load_events, merged

GAP_EDGES_US = (2, 5, 10, 50, 200, 1000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser("bench.trace_gaps", __doc__)
    p.add_argument("trace", type=Path, help="a Chrome trace exported by torch.profiler")
    p.add_argument("--top", type=int, default=25, help="kernels and host calls listed (default 25)")
    p.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    return p.parse_args(argv)


def gap_bucket(us: float) -> str:
    for edge in GAP_EDGES_US:
        if us < edge:
            return f"< {edge} us"
    return f">= {GAP_EDGES_US[-1]} us"


def report(events: list[dict], top: int) -> str:
    gpu = gpu_events(events)
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    if not gpu:
        return "no GPU events in the trace\n"
    busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    t0, t1 = busy[0][0], busy[-1][1]
    busy_us = sum(e - s for s, e in busy)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    rounds = max(1, sum(1 for e in host if e["name"] == "cudaGraphLaunch"))
    lines = [f"window {(t1 - t0) / 1e3:.2f} ms from the first GPU event to the last; GPU busy {busy_us / 1e3:.2f} ms "
             f"({busy_us / (t1 - t0):.1%}), idle {(t1 - t0 - busy_us) / 1e3:.2f} ms",
             f"per CUDA graph launch ({rounds}): busy {busy_us / rounds / 1e3:.3f} ms, idle "
             f"{(t1 - t0 - busy_us) / rounds / 1e3:.3f} ms"]
    c = collective_figures(gpu, busy_us)
    if c:  # issue 21's figure: what a step spends in the collective (its kernels include the wait for peers)
        lines += [f"in collectives: {c['ms']:.3f} ms = {c['share']:.1%} of GPU busy ({c['ms'] / rounds:.3f} ms per "
                  f"CUDA graph launch)",
                  f"  transfer (each of {c['calls']} calls as long as the fastest, {c['fastest_us']:.1f} us): "
                  f"{c['transfer_ms']:.3f} ms = {c['transfer_share']:.1%} of GPU busy; waiting for a peer: "
                  f"{c['skew_ms']:.3f} ms at the first call of a launch (launch skew), {c['wait_ms']:.3f} ms at "
                  f"the others (a peer still computing)"]
    lines += ["", "| idle gap | count | total ms |", "|---|---:|---:|"]
    by_gap: dict[str, list[float]] = defaultdict(list)
    for g in gaps:
        by_gap[gap_bucket(g)].append(g)
    order = [f"< {e} us" for e in GAP_EDGES_US] + [f">= {GAP_EDGES_US[-1]} us"]
    lines += [f"| {k} | {len(by_gap[k])} | {sum(by_gap[k]) / 1e3:.3f} |" for k in order if by_gap[k]]
    for title, evs in (("host calls (CPU time)", host), ("GPU kernels and copies (GPU time)", gpu)):
        total: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for e in evs:
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
        lines += ["", f"## {title}", "", "| name | ms | calls | per round | mean us |", "|---|---:|---:|---:|---:|"]
        for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
            short = name if len(name) < 70 else name[:67] + "..."
            lines.append(f"| `{short}` | {us / 1e3:.3f} | {calls[name]} | {calls[name] / rounds:.1f} | "
                         f"{us / calls[name]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = report(load_events(args.trace), args.top)
    print(text, end="")
    if args.out is not None:
        args.out.write_text(f"# GPU busy and idle — {args.trace.name}\n\n{text}")


if __name__ == "__main__":
    main()
