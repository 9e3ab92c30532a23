"""Train a DFlash2 drafter on the target's greedy traces (`traces.py`) with the block objective (`objective.py`):
AdamW, a short warm-up then a cosine decay, run for a step count or a time budget, whichever ends first.

Only the drafter's own weights train; the target's embedding and lm_head, which the drafter borrows, stay frozen
(they are the target's: serving reads them from the target checkpoint).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from model.dflash import DFlashDrafter

from .objective import anchor_range, block_loss, make_blocks, position_weights
from .traces import Traces

log = logging.getLogger("twinspark.train_drafter")

WARMUP_STEPS = 20


@dataclass(frozen=True)
class TrainSettings:
    max_steps: int = 2000
    max_seconds: float = 180.0
    batch: int = 128  # sequences per step, all at one anchor position
    lr: float = 3e-3
    weight_decay: float = 0.01
    gamma: float = 7.0  # loss weight exp(-(i - 1) / gamma) for block row i
    seed: int = 0


@dataclass
class TrainReport:
    steps: int
    seconds: float
    first_loss: float  # the first step's
    final_loss: float  # the mean of the last steps' (up to 50)
    final_first_hit: float  # first-draft hit rate over the same steps (full-vocabulary argmax of the selector)


def _lr_scale(step: int, done: float) -> float:
    """Warm-up over the first steps, then cosine from 1 to 0 over the run (`done` in [0, 1])."""
    return min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))


def train(drafter: DFlashDrafter, traces: Traces, embed: Tensor, head: Tensor, s: TrainSettings, *,
          progress: bool = True) -> TrainReport:
    """Train `drafter` in place on `traces` (fp32, CPU)."""
    gen = torch.Generator().manual_seed(s.seed)
    anchors = anchor_range(traces)
    weights = position_weights(drafter.config.block_size, s.gamma)
    opt = torch.optim.AdamW(drafter.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    drafter.train()
    losses: list[float] = []
    hits: list[float] = []
    t0 = time.monotonic()
    # The bar counts the run's progress in percent: the step count or the time budget, whichever is further on.
    bar = tqdm(total=100, desc="training drafter", unit="%", disable=not progress,
               bar_format="{l_bar}{bar}| {n:.0f}/100% [{elapsed}<{remaining}{postfix}]")
    step = 0
    while step < s.max_steps and time.monotonic() - t0 < s.max_seconds:
        done = max(step / s.max_steps, (time.monotonic() - t0) / s.max_seconds)
        bar.update(100 * done - bar.n)
        for group in opt.param_groups:
            group["lr"] = s.lr * _lr_scale(step, done)
        anchor = anchors[int(torch.randint(len(anchors), (1,), generator=gen))]
        seqs = torch.randperm(traces.num_seqs, generator=gen)[: s.batch]
        out = block_loss(drafter, make_blocks(drafter, traces, seqs, anchor), embed, head, weights)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
        hits.append(out.first_hits / out.blocks)
        step += 1
        if step % 50 == 0:
            bar.set_postfix(step=step, loss=f"{sum(losses[-50:]) / 50:.3f}", first_hit=f"{sum(hits[-50:]) / 50:.2f}")
            log.info("step %d: loss %.4f, first-draft hit %.3f", step, sum(losses[-50:]) / 50, sum(hits[-50:]) / 50)
    bar.close()
    drafter.eval()
    if not losses:
        raise ValueError("no training step ran (max_steps or max_seconds is 0)")
    tail = min(50, len(losses))
    return TrainReport(step, time.monotonic() - t0, losses[0], sum(losses[-tail:]) / tail, sum(hits[-tail:]) / tail)


@torch.no_grad()
def held_out(drafter: DFlashDrafter, traces: Traces, embed: Tensor, head: Tensor, gamma: float = 7.0,
             anchors: int = 8) -> tuple[float, float]:
    """The objective and the first-draft hit rate on `traces` (sequences not trained on), at `anchors` positions
    spread over the anchor range."""
    span = anchor_range(traces)
    picks = [span[i * (len(span) - 1) // max(1, anchors - 1)] for i in range(anchors)]
    weights = position_weights(drafter.config.block_size, gamma)
    seqs = torch.arange(traces.num_seqs)
    outs = [block_loss(drafter, make_blocks(drafter, traces, seqs, a), embed, head, weights) for a in picks]
    return (sum(float(o.loss) for o in outs) / len(outs),
            sum(o.first_hits for o in outs) / sum(o.blocks for o in outs))
