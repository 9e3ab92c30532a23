"""The StepPlan checksum: the scheduler seals every plan with it, every rank verifies it with the same function.

checksum = sha256 hex of the plan serialized deterministically with `checksum = ""`. A rank that sees a mismatch
(or a round gap) answers an error and stops (docs/design.md §6), so a corrupted or mixed-up plan never runs on one rank only.
"""

from __future__ import annotations

import hashlib

from twinspark.v1.rank_pb2 import StepPlan


def plan_checksum(plan: StepPlan) -> str:
    """sha256 hex of `plan` with its checksum field cleared (the message is restored before returning)."""
    saved = plan.checksum
    plan.checksum = ""  # cleared in place rather than copied: plans carry whole prefill chunks
    try:
        return hashlib.sha256(plan.SerializeToString(deterministic=True)).hexdigest()
    finally:
        plan.checksum = saved


def seal(plan: StepPlan) -> StepPlan:
    """Set `plan.checksum` (after every other field is final) and return the plan."""
    plan.checksum = plan_checksum(plan)
    return plan


def verify(plan: StepPlan) -> bool:
    """True when `plan.checksum` matches its contents."""
    return bool(plan.checksum) and plan.checksum == plan_checksum(plan)
