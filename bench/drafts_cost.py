"""What a round with drafts costs on one GPU: the target's verify window against a plain decode step, and the DFlash2
drafter's call, at real dimensions with random weights (issue 23: "verify 16 drafts <= 2x a decode step").

Measured in one run, at batch 1 (CUDA events, warm-up, median of N):
- target: the bench model of bench/decode_prefill.py (4 real-dimension layers, random weights drawn on the GPU,
  optionally `--random-weights RECIPE`), one sequence with `--context` tokens prefilled (untimed): a plain decode
  step (1 row; as a CUDA graph replay where the runtime would replay one, and eagerly), and a verify window of 1 + K
  rows for each K in `--drafts`, logits for every row, each followed by the `commit_verify` the rank makes after it;
- drafter: a DFlash2 drafter of the published GLM drafter's shape (5 layers, random bf16 weights, random target
  embedding and lm_head): `fuse` of the context rows a round brings (`--fuse-rows`) and one `propose_from_context`
  block at each of `--contexts` fused context rows (what services/drafter/dflash.py runs per request and round);
- an estimate of a round with K drafts (drafter call + fuse + verify, serial) against the K + 1 decode steps it can
  replace at best.

    python -m bench.drafts_cost --out $OUT                # on a GPU
    python -m bench.drafts_cost --tiny --out /tmp/dc      # CPU smoke test with make-tiny dimensions
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from bench import flags
from bench.model_run import (BLOCK, Setup, add_flags, add_step_flags, experts_per_layer, finish, free, is_oom,
                             random_tokens, setup)
from bench.output import RunFiles
from bench.random_weights import build_model
from bench.timing import log, median, sync, time_calls
from model.batch import Batch
from model.checkpoint.dflash_writer import tiny_dflash_config
from model.config import Dimensions
from model.dflash import DFlashConfig, DFlashDrafter
from model.quantize.select import Recipe
from model.row_store import KV_CACHE_DTYPES

# The published GLM-5.3-Flash drafter's sizes beyond the target's hidden size and vocabulary, as
# tests/model/test_dflash.py::test_published_names_and_shapes_match_reference builds it (heads, MLP and conv widths
# are Qwen3-like guesses there too: z-lab's repository does not give them).
PUBLISHED_DRAFTER = dict(num_hidden_layers=5, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, sliding_window=2048, target_layer_ids=(1, 11, 22, 32, 42), block_size=16,
                         conv_kernel_size=4, conv_group_size=16, selector_rank=256, selector_top_k=16)
ISSUE_DRAFTS = 16  # the issue's verify window: 16 drafts <= 2x a decode step
ISSUE_RATIO = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser("bench.drafts_cost", __doc__)
    p.add_argument("--drafts", type=flags.ints, default=[4, 8, 15, 16],
                   help="drafts per verify window, K (the window has 1 + K rows; default 4,8,15,16)")
    p.add_argument("--context", type=int, default=1024, help="target: tokens in the cache before timing (default 1024)")
    p.add_argument("--contexts", type=flags.ints, default=[256, 1024, 4096],
                   help="drafter: fused context rows per block (default 256,1024,4096)")
    p.add_argument("--fuse-rows", type=flags.ints, default=[1, 17],
                   help="drafter: new context rows fused per call (default 1,17: a round with nothing / all of 16 "
                        "drafts accepted)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (default 10)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls before timing (default 2; the first captures a CUDA graph or compiles)")
    add_step_flags(p)  # the target's; the drafter's weights stay --dtype
    add_flags(p, "drafts_cost", "make-tiny dimensions (target and drafter) on the CPU: a smoke test of this script")
    return p.parse_args(argv)


def _failure(e: BaseException) -> str:
    """A failed measurement's status (the traceback goes to stderr, so the run's log says where)."""
    traceback.print_exc()
    return f"{'OOM' if is_oom(e) else 'failed'}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


class Results(RunFiles):
    """Everything measured so far; written after every part, so a failure or a timeout still leaves the rest."""

    def __init__(self, run: Setup) -> None:
        super().__init__(run.out_dir, run.stem, {"meta": run.meta, "target": {"decode": [], "verify": []},
                                                 "drafter": {"config": {}, "fuse": [], "propose": []}, "rounds": [],
                                                 "summary": "", "errors": [], "notes": []})

    def error(self, part: str, e: BaseException) -> None:
        """Record a part that failed as a whole; the run goes on with the next."""
        msg = _failure(e)
        log(f"{part}: {msg}")
        self.data["errors"].append({"part": part, "error": msg})
        self.write()

    def markdown(self) -> str:
        d, m = self.data, self.data["meta"]
        t, dr = d["target"], d["drafter"]
        cfg = dr["config"]
        lines = [f"# drafts cost — {m['date']}", "",
                 f"- device: {m['device_name']} ({m['device']}), torch {m['torch']}, CUDA {m['cuda']}",
                 f"- target: random {m['dtype']} weights at {'make-tiny' if m['tiny'] else 'real GLM-5.3-Flash'} "
                 f"dims, {m['layers']} layers `{m['layer_pattern']}`, recipe {m.get('random_weights') or 'none'}, "
                 f"{m['args']['context']} tokens prefilled, batch 1",
                 f"- drafter: DFlash2, random {m['dtype']} weights, " + (
                     f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, intermediate "
                     f"{cfg['intermediate_size']}, {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads x "
                     f"{cfg['head_dim']}, window {cfg['sliding_window']}, block {cfg['block_size']}, vocab "
                     f"{cfg['vocab_size']}, selector {cfg['selector_rank']}/{cfg['selector_top_k']}" if cfg else "?"),
                 f"- timing: {m['timer']}, {m['args']['warmup']} warm-up call(s), median of "
                 f"{m['args']['iters']}", ""]
        if d["summary"]:
            lines += [f"**{d['summary']}**", ""]
        lines += ["## Target (batch 1)", "",
                  "| step | rows | mode | median ms | / decode | / eager decode | logit rows "
                  "| experts hit / MoE layer |",
                  "|---|---:|---|---:|---:|---:|---:|---|"]
        for r in t["decode"] + t["verify"]:
            name = f"verify {r['drafts']} drafts" if "drafts" in r else "decode"
            if r.get("status") != "ok":
                lines.append(f"| {name} | {r['rows']} | {r.get('mode', '')} | {r.get('status')} | | | | |")
                continue
            hit = "/".join(map(str, r.get("experts_hit") or []))
            lines.append(f"| {name} | {r['rows']} | {r['mode']} | {r['median_ms']:.3f} | "
                         f"{_ratio(r.get('ratio'))} | {_ratio(r.get('ratio_eager'))} | {r['logit_rows']} | {hit} |")
        lines += ["", "## Drafter (batch 1)", "", "| call | rows | median ms |", "|---|---:|---:|"]
        for r in dr["fuse"]:
            lines.append(f"| fuse (new context rows) | {r['rows']} | {_ms(r.get('median_ms')) or r.get('status')} |")
        for r in dr["propose"]:
            lines.append(f"| propose_from_context (one block over C context rows) | C = {r['context']} | "
                         f"{_ms(r.get('median_ms')) or r.get('status')} |")
        if d["rounds"]:
            r0 = d["rounds"][0]
            lines += ["", f"## A round with K drafts (estimate: drafter call at context {r0['drafter_context']} + "
                      f"fuse of {r0['fuse_rows']} rows + verify window, run one after the other)", "",
                      "| K | round ms | K + 1 decode steps ms | break-even tokens / round "
                      "| speed-up if all K accepted |",
                      "|---:|---:|---:|---:|---:|"]
            for r in d["rounds"]:
                lines.append(f"| {r['drafts']} | {r['round_ms']:.3f} | {r['decode_steps_ms']:.3f} | "
                             f"{r['break_even_tokens']:.2f} | {r['best_speedup']:.2f}x |")
        lines.append("")
        lines += [f"- {n}" for n in d["notes"]]
        lines += [f"- error in {e['part']}: {e['error']}" for e in d["errors"]]
        return "\n".join(lines) + "\n"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def measure(call: Callable[[int], object], args: argparse.Namespace, device: torch.device) -> dict:
    """`call(i)` timed: the row fields of an ok measurement."""
    times = time_calls(call, warmup=args.warmup, iters=args.iters, device=device)
    return {"status": "ok", "median_ms": median(times), "times_ms": times, "iters": args.iters}


def bench_target(res: Results, run: Setup, args: argparse.Namespace) -> None:
    """Decode step and verify windows at batch 1 on the bench model (built here, dropped on return)."""
    device, spec, meta = run.device, run.spec, res.data["meta"]
    log("target: building the bench model from random weights on the device")
    t0 = time.perf_counter()
    recipe = Recipe.parse(args.random_weights) if args.random_weights else None
    model, reader = build_model(spec, device=device, dtype=run.dtype, seed=args.seed, virtual=args.virtual,
                                recipe=recipe, log=log)
    sync(device)
    meta["build_s"] = time.perf_counter() - t0
    log(f"target: built in {meta['build_s']:.1f} s")
    drafts = sorted(set(args.drafts))
    calls = args.warmup + args.iters
    # Every call advances the sequence by one position (a decode step commits its row; a verify window is committed
    # with 0 drafts accepted), so the context stays within a few dozen tokens of --context for every measurement.
    cap = args.context + calls * (2 + len(drafts)) + max(drafts, default=0) + 1
    nb = -(-cap // BLOCK)
    cache = model.new_cache(num_blocks=nb, block_size=BLOCK, num_slots=1, kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
    table = torch.arange(nb, dtype=torch.long, device=device).view(1, nb)
    gen = torch.Generator().manual_seed(args.seed + 1)
    log(f"target: prefilling {args.context} tokens (untimed)")
    model.forward(Batch(token_ids=torch.tensor(random_tokens(args.context, spec.vocab_size, gen), device=device),
                        starts=[0], lengths=[args.context], block_tables=table, slots=[0],
                        logit_rows=torch.tensor([args.context - 1])), cache)
    sync(device)
    graphs = None
    if device.type == "cuda" and not args.enforce_eager:
        from model.cuda_graphs import DecodeGraphs
        graphs = DecodeGraphs(model, cache)
    pos = args.context

    def window(start: int, rows: int) -> Batch:
        """One sequence's `rows` new rows at `start`, logits for all: a decode step (1 row) or a verify window."""
        return Batch(token_ids=torch.tensor(random_tokens(rows, spec.vocab_size, gen), device=device),
                     starts=[start], lengths=[rows], block_tables=table, slots=[0], logit_rows=torch.arange(rows),
                     verify=[True] if rows > 1 else None)

    def experts_hit(b: Batch) -> list[int]:
        """Distinct routed experts the window's rows pick per MoE layer, from one eager forward of its first batch
        (untimed, a warm-up call more): what the MoE must read, or decode, against a one-row step's top-k."""
        hits = experts_per_layer(spec, sum(b.lengths), lambda: model.forward(b, cache))
        if b.has_verify:
            model.commit_verify(b, cache, {0: 0})
        return [h["real"] for h in hits]

    def timed(rows: int, eager: bool) -> dict:
        nonlocal pos
        batches = [window(pos + i, rows) for i in range(calls)]  # built before timing
        pos += calls
        graph = graphs is not None and not eager and graphs.fits(batches[0])
        row: dict = {"rows": rows, "mode": "graph" if graph else "eager", "context": batches[0].starts[0]}
        row["experts_hit"] = experts_hit(batches[0]) if not eager or graphs is None else None

        def call(i: int) -> None:
            b = batches[i]
            out = graphs.run(b) if graph else model.forward(b, cache)
            if b.has_verify:  # the rank commits the window's KDA state after every verify forward (device copies)
                model.commit_verify(b, cache, {0: 0})
            row["logit_rows"] = out.logits.shape[0]

        try:
            row.update(measure(call, args, device))
        except Exception as e:  # noqa: BLE001 - record it and go on with the next measurement
            row["status"] = _failure(e)
            free(device)
        log(f"target: {rows} row(s) {row['mode']}: " + (f"{row['median_ms']:.3f} ms" if row["status"] == "ok"
                                                          else row["status"]))
        return row

    t = res.data["target"]
    modes = [False, True] if graphs is not None else [True]  # eager: the mode of a round that fits no graph
    t["decode"] = [timed(1, eager) for eager in modes]
    res.write()
    ok = {r["mode"]: r["median_ms"] for r in t["decode"] if r["status"] == "ok"}
    ref = ok.get("graph", ok.get("eager"))
    for k in drafts:
        row = {"drafts": k, **timed(1 + k, eager=False)}
        if row["status"] == "ok":
            row["ratio"] = row["median_ms"] / ref if ref else None
            row["ratio_eager"] = row["median_ms"] / ok["eager"] if "eager" in ok else None
        t["verify"].append(row)
        res.write()
    if graphs is not None and any(r["mode"] == "eager" for r in t["verify"]):
        res.data["notes"].append("some verify windows ran eagerly (more rows than DecodeGraphs.window_rows), so "
                                 "their '/ decode' compares an eager window with a graph replay; '/ eager decode' "
                                 "compares like with like.")


def drafter_config(run: Setup) -> DFlashConfig:
    """The published GLM drafter's shape (make-tiny's drafter with --tiny) at the bench target's hidden size and
    vocabulary; it reads 5 layers of the whole 45-layer target, not of the 4-layer bench model (its cost depends
    only on how many: fc's input is 5 x hidden)."""
    target = {"hidden_size": run.spec.hidden_size, "vocab_size": run.spec.vocab_size,
              "num_hidden_layers": Dimensions().num_hidden_layers}
    # The mask id does not change the cost; the last id is valid at any vocabulary.
    config = tiny_dflash_config(target, mask_token_id=run.spec.vocab_size - 1)
    return config if run.meta["tiny"] else replace(config, **PUBLISHED_DRAFTER)


@torch.inference_mode()
def bench_drafter(res: Results, run: Setup, args: argparse.Namespace) -> None:
    """fuse and propose_from_context at batch 1 on a random drafter at the published shape."""
    device, dtype = run.device, run.dtype
    config = drafter_config(run)
    res.data["drafter"]["config"] = asdict(config)
    log(f"drafter: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}; "
        "drawing random weights on the device")
    gen = torch.Generator(device).manual_seed(args.seed + 2)
    with torch.device(device):
        drafter = DFlashDrafter(config).to(dtype).eval()
    # Linears ~ N(0, 1/fan_in) and norms at 1 keep every activation O(1) in bf16; the values do not change the cost.
    for name, p in drafter.named_parameters():
        if not name.endswith("norm.weight"):
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    h, v = config.hidden_size, config.vocab_size
    embed = torch.randn(v, h, device=device, dtype=dtype, generator=gen)
    head = torch.randn(v, h, device=device, dtype=dtype, generator=gen) * h ** -0.5
    width = len(config.target_layer_ids) * h  # one context row: the target layers' outputs, concatenated

    def rows_of(n: int) -> torch.Tensor:
        return torch.randn(n, width, device=device, dtype=dtype, generator=gen)

    dr = res.data["drafter"]
    for n in sorted(set(args.fuse_rows)):
        inputs = rows_of(n)
        row: dict = {"rows": n}
        try:
            row.update(measure(lambda i: drafter.fuse(inputs), args, device))
        except Exception as e:  # noqa: BLE001
            row["status"] = _failure(e)
        log(f"drafter: fuse {n} row(s): {_ms(row.get('median_ms')) or row['status']} ms")
        dr["fuse"].append(row)
        res.write()
    q = config.block_size
    for c in sorted(set(args.contexts)):
        row = {"context": c}
        try:
            # As DFlashDraftMethod._draft: the anchor (last committed token, at position c) and block_size - 1 masks
            # over the fused rows of positions 0 .. c - 1.
            context = drafter.fuse(rows_of(c))[None]
            block = drafter.mask_block(torch.randint(0, v, (1,), device=device, generator=gen))
            positions = torch.arange(c + q, device=device)[None]

            def call(i: int) -> None:
                drafts = drafter.propose_from_context(context, block, positions, embed, head)
                row["drafts_per_block"] = drafts.shape[1]

            row.update(measure(call, args, device))
        except Exception as e:  # noqa: BLE001
            row["status"] = _failure(e)
            free(device)
        log(f"drafter: propose over {c} context rows: {_ms(row.get('median_ms')) or row['status']} ms")
        dr["propose"].append(row)
        res.write()


def summarize(res: Results, args: argparse.Namespace) -> None:
    """The round estimates and the summary line, from whatever measurements succeeded."""
    d = res.data
    decode = {r["mode"]: r["median_ms"] for r in d["target"]["decode"] if r.get("status") == "ok"}
    decode_ms = decode.get("graph", decode.get("eager"))
    verify = {r["drafts"]: r for r in d["target"]["verify"] if r.get("status") == "ok"}
    propose = {r["context"]: r["median_ms"] for r in d["drafter"]["propose"] if r.get("status") == "ok"}
    fuse = {r["rows"]: r["median_ms"] for r in d["drafter"]["fuse"] if r.get("status") == "ok"}
    # The drafter's context nearest the target's, so the estimate prices one consistent sequence.
    c = min(propose, key=lambda x: (abs(x - args.context), x)) if propose else None
    if decode_ms and c is not None and fuse:
        n = max(fuse)  # a round brings accepted + 1 <= K + 1 new rows: the largest fuse measured bounds it
        for k, r in sorted(verify.items()):
            round_ms = propose[c] + fuse[n] + r["median_ms"]
            d["rounds"].append({"drafts": k, "drafter_context": c, "fuse_rows": n, "round_ms": round_ms,
                                "decode_steps_ms": (k + 1) * decode_ms, "break_even_tokens": round_ms / decode_ms,
                                "best_speedup": (k + 1) * decode_ms / round_ms})
        d["notes"].append("round estimate: drafter call + fuse + verify window back to back on one GPU (no overlap, "
                          "no scheduler or RPC time); break-even = round ms / decode ms, the committed tokens per "
                          "round at which drafting stops losing; the speed-up if all K are accepted is an upper "
                          f"bound (a DFlash2 block proposes at most block_size - 1 = "
                          f"{d['drafter']['config'].get('block_size', 16) - 1} drafts).")
    k = ISSUE_DRAFTS if ISSUE_DRAFTS in verify else max(verify, default=None)
    drafter_part = f"drafter call at context {c}: {propose[c]:.2f} ms" if c is not None else "drafter call: n/a"
    ratio = verify[k].get("ratio") if k is not None else None
    verify_part = (f"verify {k} drafts / decode = {ratio:.2f} (target <= {ISSUE_RATIO:g})" if ratio is not None
                   else f"verify {ISSUE_DRAFTS} drafts / decode = n/a (target <= {ISSUE_RATIO:g})")
    d["summary"] = f"{drafter_part}; {verify_part}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = setup(args, "drafts_cost")
    if run is None:
        return 2
    meta = run.meta
    meta.update(random_weights=args.random_weights,
                timer="CUDA events" if run.device.type == "cuda" else "perf_counter")
    res = Results(run)
    res.data["notes"] += [
        "verify window: one sequence, rows = the last committed token + K random drafts, logits for every row; each "
        "timed call is the forward and the commit_verify after it (it copies each KDA layer's kept state into the "
        "slot on the device), committed with 0 drafts accepted so every call advances the sequence by one position.",
        "decode: the same sequence, one row, logits for it; 'graph' = a DecodeGraphs replay (captured in the warm-up), "
        "'eager' = model.forward.",
        "experts hit: the distinct routed experts a step's rows pick in each MoE layer (one untimed eager call): "
        "random drafts route each row to its own top-k at random, so a window's MoE reads (or, for EXL3, decodes) "
        "about as many experts as that many independent tokens would, where a real model's consecutive tokens "
        "share some.",
        "drafter: propose_from_context = embed the block, 5 layers over [context, block], lm_head on the 15 rows after "
        "the anchor, candidate selector (greedy, 15 sequential picks); fuse = fc + norm of the new rows.",
    ]
    log(f"device {meta['device_name']} ({run.device}), torch {torch.__version__}; results -> {res.json_path}")
    res.write()
    for part, fn in (("target", bench_target), ("drafter", bench_drafter)):
        try:
            fn(res, run, args)
        except Exception as e:  # noqa: BLE001 - a part that fails is recorded; the other still runs
            res.error(part, e)
        free(run.device)
    summarize(res, args)
    if run.device.type == "cuda":
        meta["gpu_peak_mem_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    finish(res, run)
    log(res.data["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
