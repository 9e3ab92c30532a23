"""The step budget's default: tokens one round may carry when --max-num-batched-tokens is not given.

Shared by the scheduler (which cuts rounds to it) and the ranks (which warm up at it before serving)."""

from __future__ import annotations

# By the ranks' device. On a GPU, vLLM's and SGLang's default on H100 / H200-class GPUs: long prompts prefill in big
# chunks (a round is one forward) while the decode rows still go first in every round. On the CPU, small rounds keep
# the tiny model's streams responsive.
DEFAULT_STEP_TOKENS = {"cuda": 8192, "cpu": 256}


def step_budget(given: int | None, device: str) -> int:
    """The round's token budget: `given`, else the device's default."""
    return given if given is not None else DEFAULT_STEP_TOKENS.get(device, DEFAULT_STEP_TOKENS["cpu"])
