"""`twinspark train-drafter`: train a DFlash2 drafter on a target checkpoint's own greedy continuations, on the CPU.

Steps: draw random prompts (ordinary token ids: the tiny target is random, text means nothing to it), let the target
continue them greedily in-process (fp32) while recording the drafter's target layers, train the drafter from
`--init` (default MODEL/dflash2, what `make-tiny --drafter dflash` writes) with the block objective for a step count
or a time budget, and write the trained drafter to `--out` in the published layout (`up --drafter dflash
--drafter-model OUT` serves it), with training.json beside it: the settings, the data, the loss and the first-draft
hit rate on held-out prompts before and after.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common import shared_flags as shared
from services.common.flags import add_subcommand, flag

log = logging.getLogger("twinspark.train_drafter")


@dataclass(frozen=True, kw_only=True)
class TrainDrafterSettings:
    model: str = flag(shared.MODEL, help="the target checkpoint (the tiny one from `make-tiny`)", required=True)
    init: str | None = flag("init", "the drafter to start from: config.json + safetensors (default MODEL/dflash2)",
                            metavar="DIR", env="TRAIN_DRAFTER_INIT")
    out: str = flag("out", "folder to write the trained drafter into (created if missing)", metavar="DIR",
                    required=True, env="TRAIN_DRAFTER_OUT")
    prompts: int = flag("prompts", "training prompts", default="1024", type=int, env="TRAIN_DRAFTER_PROMPTS")
    held_out: int = flag("held-out", "held-out prompts (another seed) for the before / after figures", default="32",
                         type=int, env="TRAIN_DRAFTER_HELD_OUT")
    prompt_tokens: int = flag("prompt-tokens", "tokens per prompt", default="16", type=int,
                              env="TRAIN_DRAFTER_PROMPT_TOKENS")
    new_tokens: int = flag("new-tokens", "greedy tokens the target adds to each prompt", default="48", type=int,
                           env="TRAIN_DRAFTER_NEW_TOKENS")
    steps: int = flag("steps", "training steps at most", default="10000", type=int, env="TRAIN_DRAFTER_STEPS")
    seconds: float = flag("seconds", "training time budget in seconds (data generation not counted)",
                          default="240", type=float, env="TRAIN_DRAFTER_SECONDS")
    batch: int = flag("batch", "blocks per step", default="128", type=int, env="TRAIN_DRAFTER_BATCH")
    lr: float = flag("lr", "peak AdamW learning rate", default="3e-3", type=float, env="TRAIN_DRAFTER_LR")
    seed: int = flag("seed", "seed of the prompts (held-out: seed + 1) and of the training order", default="0",
                     type=int, env="TRAIN_DRAFTER_SEED")
    dtype: str = flag("dtype", "storage dtype of the written weights", default="float32",
                      choices=("float32", "bfloat16"), env="TRAIN_DRAFTER_DTYPE")
    threads: int = flag("threads", "torch CPU threads (0: torch's default)", default="0", type=int,
                        env="TRAIN_DRAFTER_THREADS")
    log_level: str = flag(shared.LOG_LEVEL)


def register(sub: argparse._SubParsersAction) -> None:
    add_subcommand(sub, "train-drafter", TrainDrafterSettings, train_drafter,
                   help="train a DFlash2 drafter on the target's own greedy outputs (CPU, fp32)",
                   description=__doc__.split("\n\n", 1)[1])


def train_drafter(s: TrainDrafterSettings) -> int:
    import torch

    from model.dflash import load_drafter
    from model.dflash.weights import save_checkpoint
    from model.model import Glm5Model

    from model.dflash.train.traces import generate_traces, random_prompts, target_embed_head
    from model.dflash.train.trainer import TrainSettings, held_out, train

    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    init = Path(s.init or Path(s.model) / "dflash2")
    drafter = load_drafter(init)
    layers = list(drafter.config.target_layer_ids)
    target = Glm5Model.load(s.model, dtype=torch.float32, progress=False)
    embed, head = target_embed_head(s.model)
    t0 = time.monotonic()
    data = generate_traces(target, random_prompts(s.model, s.prompts, s.prompt_tokens, s.seed), s.new_tokens, layers)
    test = generate_traces(target, random_prompts(s.model, s.held_out, s.prompt_tokens, s.seed + 1), s.new_tokens,
                           layers)
    gen_s = time.monotonic() - t0
    log.info("%d training and %d held-out traces of %d tokens in %.1f s", data.num_seqs, test.num_seqs, data.length,
             gen_s)
    before = held_out(drafter, test, embed, head)
    settings = TrainSettings(max_steps=s.steps, max_seconds=s.seconds, batch=s.batch, lr=s.lr, seed=s.seed)
    report = train(drafter, data, embed, head, settings)
    after = held_out(drafter, test, embed, head)
    log.info("trained %d steps in %.1f s: loss %.3f -> %.3f; held-out loss %.3f -> %.3f, first-draft hit %.3f -> "
             "%.3f", report.steps, report.seconds, report.first_loss, report.final_loss, before[0], after[0],
             before[1], after[1])
    files = save_checkpoint(s.out, drafter.config, drafter.state_dict(), dtype=s.dtype)
    record = {"settings": asdict(s), "init": str(init), "train_sequences": data.num_seqs,
              "held_out_sequences": test.num_seqs, "sequence_tokens": data.length, "prompt_tokens": data.prompt_len,
              "generate_seconds": round(gen_s, 1), "training": asdict(report),
              "held_out_before": {"loss": before[0], "first_draft_hit": before[1]},
              "held_out_after": {"loss": after[0], "first_draft_hit": after[1]}}
    (Path(s.out) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote the trained drafter to {s.out}: " + ", ".join(f.name for f in files) + ", training.json")
    return 0
