"""Mean accepted length of DFlash2 drafts (a trained drafter and the untrained one it started from) against copy
drafts, on held-out prompts of the tiny target (issue 23: does training the drafter on the target's own greedy outputs
carry signal through the loop?).

The target continues the held-out prompts greedily (`model/dflash/train/traces.py`: the rows and tokens a served
request produces); each draft method then replays serving's rounds over every trace with the drafter service's own
classes (`services/drafter`: `CopyDrafter`, `DFlashDraftMethod`): a round asks for up to K drafts after the committed
tokens (K capped so the window never passes the trace's end, as the scheduler caps it at max_tokens), delivering the
context rows the ranks would have returned since the last call; greedy verification accepts the longest run of drafts
equal to the target's tokens and commits them plus the bonus token. Mean accepted length = committed tokens per round
(1 + accepted drafts; a round without drafts commits 1).

    python -m bench.drafter_acceptance --model CKPT --drafter TRAINED --out bench/results

Writes drafter_acceptance-<time>.json and .md.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import flags
from bench.output import write_results
from bench.stack import attach_or_start, load_line, machine_load
from model.dflash.train.traces import Traces


@dataclass
class Acceptance:
    rounds: int
    committed: int  # tokens the rounds committed (the first generated token, from the prefill, not counted)
    drafted: int
    accepted: int

    @property
    def mean_accepted_length(self) -> float:
        return self.committed / self.rounds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def replay(method, traces: Traces, k: int) -> Acceptance:
    """Serving's decode rounds over every trace with `method` (a drafter-service draft method) and up to `k` drafts."""
    total = Acceptance(0, 0, 0, 0)
    for s in range(traces.num_seqs):
        tokens = traces.tokens[s].tolist()
        rid = f"k{k}-seq{s}"  # a context of its own for every replay, should a method be replayed twice
        n = traces.prompt_len + 1  # the prefill's sample is committed: position P holds the first anchor
        delivered = 0  # context rows handed to the drafter: positions 0 .. delivered - 1
        while n < len(tokens):
            rows = traces.hidden[s, delivered : n - 1]
            drafts = method.propose(rid, tokens[:n], min(k, len(tokens) - n - 1), rows, delivered)
            delivered = n - 1
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == tokens[n + accepted]:
                accepted += 1
            total.rounds += 1
            total.committed += accepted + 1
            total.drafted += len(drafts)
            total.accepted += accepted
            n += accepted + 1
    return total


def served(model: str, drafter: str, traces: Traces, k: int) -> tuple[Acceptance, int]:
    """The same prompts through `twinspark up --tp 1 --drafter dflash --drafter-model DRAFTER` at K drafts a round,
    greedy: the acceptance read off each reply's usage (a reply of n tokens took n - 1 - accepted decode rounds
    after the prefill's sample), and how many replies equal the traces' continuations."""
    import httpx

    env = {"TWINSPARK_DRAFTER": "dflash", "TWINSPARK_DRAFTER_MODEL": drafter, "TWINSPARK_NUM_DRAFT_TOKENS": str(k),
           "TWINSPARK_MAX_RESTARTS": "0"}
    stack = attach_or_start(None, tp=1, model=model, env=env)
    total, same, p = Acceptance(0, 0, 0, 0), 0, traces.prompt_len
    try:
        for s in range(traces.num_seqs):
            body = {"prompt": traces.tokens[s, :p].tolist(), "max_tokens": traces.length - p, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
            r.raise_for_status()
            ids, usage = r.json()["choices"][0]["token_ids"], r.json()["usage"]["twinspark"]
            same += ids == traces.tokens[s, p:].tolist()
            total.rounds += len(ids) - 1 - usage["accepted"]
            total.committed += len(ids) - 1
            total.drafted += usage["drafted"]
            total.accepted += usage["accepted"]
    finally:
        stack.down()
    return total, same


def evaluate(model: str, drafters: dict[str, str], traces: Traces, ks: list[int]) -> dict[str, dict[int, Acceptance]]:
    """method name -> K -> acceptance, for copy drafts and each DFlash2 drafter folder of `drafters` (name -> dir)."""
    from services.drafter.dflash import DFlashDraftMethod
    from services.drafter.methods import CopyDrafter

    methods = {"copy": CopyDrafter(), **{name: DFlashDraftMethod(d, model) for name, d in drafters.items()}}
    return {name: {k: replay(m, traces, k) for k in ks} for name, m in methods.items()}


def table(results: dict[str, dict[int, Acceptance]]) -> str:
    lines = ["| drafts | K | rounds | mean accepted length | drafted | accepted | acceptance rate |",
             "|---|---|---|---|---|---|---|"]
    for name, by_k in results.items():
        for k, a in by_k.items():
            lines.append(f"| {name} | {k} | {a.rounds} | {a.mean_accepted_length:.3f} | {a.drafted} | {a.accepted} "
                         f"| {a.acceptance_rate:.3f} |")
    return "\n".join(lines) + "\n"


def _training_line(t: dict | None) -> str:
    """What train-drafter's training.json says, in a sentence."""
    if t is None:
        return "The trained drafter's folder has no training.json."
    r, b, a = t["training"], t["held_out_before"], t["held_out_after"]
    return (f"The trained drafter (`twinspark train-drafter`): {t['train_sequences']} traces of {t['sequence_tokens']} "
            f"tokens ({t['prompt_tokens']} prompt), generated in {t['generate_seconds']} s; {r['steps']} steps in "
            f"{r['seconds']:.0f} s, loss {r['first_loss']:.2f} -> {r['final_loss']:.2f}; on its own "
            f"{t['held_out_sequences']} held-out traces, loss {b['loss']:.2f} -> {a['loss']:.2f} and first-draft hit "
            f"rate {b['first_draft_hit']:.3f} -> {a['first_draft_hit']:.3f}.")


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.drafter_acceptance", __doc__)
    ap.add_argument("--model", required=True, help="the target checkpoint (make-tiny)")
    ap.add_argument("--drafter", required=True, help="the trained DFlash2 drafter (train-drafter --out)")
    ap.add_argument("--untrained", help="the drafter it started from (default MODEL/dflash2)")
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt (default 16)")
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    flags.add(ap, flags.SEED, "prompt seed, away from train-drafter's (its seed and seed + 1) (default 1000)",
              default="1000")
    ap.add_argument("--k", default="4,15", help="drafts asked per round, comma separated (default 4,15: serving's "
                    "default and the block's 15)")
    ap.add_argument("--served", action="store_true", help="also serve the trained drafter (`twinspark up --tp 1`) "
                    "at the first K and read its acceptance off the replies' usage")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    flags.add(ap, flags.OUT, "folder for the .json / .md (default: print only)")
    args = ap.parse_args(argv)
    from model.dflash import DFlashConfig
    from model.dflash.train.traces import generate_traces, random_prompts
    from model.model import Glm5Model

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    drafters = {"dflash2 trained": args.drafter,
                "dflash2 untrained": args.untrained or str(Path(args.model) / "dflash2")}
    layers = {DFlashConfig.from_file(d).target_layer_ids for d in drafters.values()}
    if len(layers) != 1:
        raise SystemExit(f"the drafters read different target layers: {sorted(layers)}")
    before = machine_load()
    t0 = time.monotonic()
    target = Glm5Model.load(args.model, dtype=torch.float32, progress=False)
    traces = generate_traces(target, random_prompts(args.model, args.prompts, args.prompt_tokens, args.seed),
                             args.new_tokens, list(layers.pop()))
    ks = [int(k) for k in args.k.split(",")]
    results = evaluate(args.model, drafters, traces, ks)
    body = table(results)
    same = None
    if args.served:
        got, same = served(args.model, args.drafter, traces, ks[0])
        results["dflash2 trained, served"] = {ks[0]: got}
        body = table(results) + f"\nServed replies equal to the traces' greedy continuations: {same}/{args.prompts}.\n"
    seconds = time.monotonic() - t0
    print(body)
    record = Path(args.drafter) / "training.json"
    training = json.loads(record.read_text()) if record.exists() else None
    md = (f"# Drafter acceptance on held-out prompts\n\n{args.prompts} held-out prompts of {args.prompt_tokens} "
          f"random ordinary ids (seed {args.seed}), {args.new_tokens} greedy tokens each from the target "
          f"`{args.model}`; serving's rounds replayed with the drafter service's methods (bench/drafter_acceptance.py)."
          f"\n\n{_training_line(training)}\n\n{body}\n{load_line(before, machine_load())} Took {seconds:.0f} s.\n")
    data = {"meta": {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": round(seconds, 1),
                     "load_before": before, "served_replies_equal": same, "training": training},
            "results": {name: {str(k): {**asdict(a), "mean_accepted_length": a.mean_accepted_length,
                                        "acceptance_rate": a.acceptance_rate} for k, a in by_k.items()}
                        for name, by_k in results.items()}}
    write_results(args.out, "drafter_acceptance", data, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
