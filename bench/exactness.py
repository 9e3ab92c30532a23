"""Concurrency never changes answers, checked through HTTP against a stack: 12 completions of mixed prompt lengths
(greedy and seeded T=0.8) served one by one (the references), then staggered 50 ms apart, then all at once; the
token ids must match 12/12 each way. tests/gpu/test_served_cuda.py runs it on a started CUDA stack; bench/whole_model
on the 45-layer model.

    python -m bench.exactness --state-dir ~/.local/state/twinspark     # a running stack
    python -m bench.exactness --tp 2 --model DIR                        # one started here

Prints a line per request (its verdicts and the distinct tokens among its reply's first 32), then
`replies with >= 8 distinct tokens in their first 32: N/12`, then `staggered N/12, burst N/12` (and with
--same-as the comparison with the other run) as the last lines; exits 1 when either count is short. The distinct
counts say how much the check is worth: a reply of one token repeated comes out the same even when the logits
drift, so the counts pass on a model that never varies its answer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import flags
from bench.concurrency_check import check, requests, same_requests
from bench.stack import add_stack_args, attach_or_start

FIRST = 32  # the tokens of a reply whose variety is counted
VARIED = 8  # distinct tokens among them that make a reply more than a token or two repeated


def distinct_tokens(ids: list[int], first: int = FIRST) -> int:
    """Distinct ids among a reply's first `first`."""
    return len(set(ids[:first]))


def varied_replies(replies: list[list[int]], *, first: int = FIRST, least: int = VARIED) -> int:
    """Replies with at least `least` distinct ids among their first `first`."""
    return sum(distinct_tokens(r, first) >= least for r in replies)


def varied_line(replies: list[list[int]]) -> str:
    return f"replies with >= {VARIED} distinct tokens in their first {FIRST}: {varied_replies(replies)}/{len(replies)}"


def _verdict(mine: list[int], other: list[int]) -> str:
    return "same" if mine == other else "DIFFERENT"


def request_lines(bodies: list[dict], serial_ids: list[list[int]], staggered: list[list[int]],
                  burst: list[list[int]], theirs: tuple[str, list[list[int]]] | None = None) -> list[str]:
    """One line per request: its sampling, prompt and reply lengths, whether the staggered and burst passes (and
    `theirs`, another run's (label, serial ids) of the same mix) gave its serial ids, and its distinct tokens."""
    lines = []
    for i, (body, ref) in enumerate(zip(bodies, serial_ids)):
        temp = body.get("temperature", 1.0)
        verdicts = [f"staggered {_verdict(staggered[i], ref)}", f"burst {_verdict(burst[i], ref)}"]
        if theirs is not None and len(theirs[1]) == len(serial_ids):
            verdicts.append(f"{theirs[0]} {_verdict(theirs[1][i], ref)}")
        lines.append(f"request {i:2d} ({'greedy' if temp == 0 else f'T={temp:g}'}, {len(body['prompt'])}-id "
                     f"prompt, {len(ref)} tokens): {', '.join(verdicts)}; {distinct_tokens(ref)} distinct in its "
                     f"first {FIRST}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.exactness", __doc__)
    add_stack_args(ap)
    ap.add_argument("--label", default="stack", help="what the printed line calls the stack")
    ap.add_argument("--json", type=Path, default=None,
                    help="also write the counts, the serial token ids and their distinct-token counts here")
    ap.add_argument("--same-as", type=Path, default=None, metavar="JSON",
                    help="another stack's --json (e.g. TP 1's): also compare the serial token ids with its own, "
                         "request by request, and fail unless all are equal")
    args = ap.parse_args(argv)
    other = json.loads(args.same_as.read_text()) if args.same_as else None
    bodies = requests()
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model)
    try:
        result = check(stack.url + "/v1", bodies)
    finally:
        stack.down()
    ref = result.serial
    theirs = (other["label"], other["serial_token_ids"]) if other else None
    print("\n".join(request_lines(bodies, ref, result.staggered, result.burst, theirs)), flush=True)
    print(varied_line(ref), flush=True)
    # The last lines, which bench/gpu_check.sh's tp2one tails: the counts, then the comparison with --same-as.
    print(result.line(args.label), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "staggered_same": result.staggered_same,
                                         "burst_same": result.burst_same, "n": len(result.serial),
                                         "serial_token_ids": result.serial,
                                         f"distinct_in_first_{FIRST}": [distinct_tokens(r) for r in ref],
                                         f"replies_with_{VARIED}_distinct": varied_replies(ref)}) + "\n")
    same = True
    if other is not None:
        equal = same_requests(result.serial, other["serial_token_ids"])
        same = equal == len(result.serial)
        print(f"{args.label} serial = {other['label']} serial: {equal}/{len(result.serial)} requests, the same "
              f"token ids", flush=True)
    return 0 if result.exact and same else 1


if __name__ == "__main__":
    sys.exit(main())
