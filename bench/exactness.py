"""Concurrency never changes answers, checked through HTTP against a stack: 12 completions of mixed prompt lengths
(greedy and seeded T=0.8) served one by one (the references), then staggered 50 ms apart, then all at once; the
token ids must match 12/12 each way. tests/gpu/test_served_cuda.py runs it on a started CUDA stack; bench/whole_model
on the 45-layer model.

    python -m bench.exactness --state-dir ~/.local/state/twinspark     # a running stack
    python -m bench.exactness --tp 2 --model DIR                        # one started here

Prints `staggered N/12, burst N/12`; exits 1 when either is short.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import flags
from bench.concurrency_check import check, same_requests
from bench.stack import add_stack_args, attach_or_start


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.exactness", __doc__)
    add_stack_args(ap)
    ap.add_argument("--label", default="stack", help="what the printed line calls the stack")
    ap.add_argument("--json", type=Path, default=None, help="also write the counts and the serial token ids here")
    ap.add_argument("--same-as", type=Path, default=None, metavar="JSON",
                    help="another stack's --json (e.g. TP 1's): also compare the serial token ids with its own, "
                         "request by request, and fail unless all are equal")
    args = ap.parse_args(argv)
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model)
    try:
        result = check(stack.url + "/v1")
    finally:
        stack.down()
    print(result.line(args.label), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "staggered_same": result.staggered_same,
                                         "burst_same": result.burst_same, "n": len(result.serial),
                                         "serial_token_ids": result.serial}) + "\n")
    same = True
    if args.same_as:
        other = json.loads(args.same_as.read_text())
        equal = same_requests(result.serial, other["serial_token_ids"])
        same = equal == len(result.serial)
        print(f"{args.label} serial = {other['label']} serial: {equal}/{len(result.serial)} requests, the same "
              f"token ids", flush=True)
    return 0 if result.exact and same else 1


if __name__ == "__main__":
    sys.exit(main())
