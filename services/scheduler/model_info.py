"""What a rank group says about itself in its Describe replies: the model and cache the scheduler serves
(`ModelInfo`), and how two replies differ when they should not.

Kept apart from the gRPC clients in ranks.py because most of the scheduler (admission checks, the KV cache manager,
the round scheduler) needs only these facts, never a connection to a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.step_budget import step_budget
from twinspark.v1 import rank_pb2


@dataclass(frozen=True)
class ModelInfo:
    """What the scheduler takes from rank 0's Describe (all ranks agree, the fingerprint says so)."""

    model: str
    fingerprint: str
    world: int
    num_blocks: int
    block_size: int
    num_slots: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_model_len: int
    # KV tiers (every rank's capacity, the smallest counts; per-rank sizes of a block and a KDA state there)
    tier_host_bytes: int = 0
    tier_disk_bytes: int = 0
    block_bytes: int = 0
    state_bytes: int = 0
    device: str = "cpu"  # where the ranks compute (their fingerprint's settings)
    step_budget: int = 0  # the round budget the ranks sized their memory for (the smallest); 0: not reported

    @classmethod
    def from_describe(cls, d: rank_pb2.DescribeReply, group: list[rank_pb2.DescribeReply] | None = None
                      ) -> "ModelInfo":
        group = group or [d]
        return cls(model=d.model, fingerprint=d.fingerprint, world=d.world, num_blocks=d.num_blocks,
                   block_size=d.block_size, num_slots=d.num_slots, vocab_size=d.vocab_size,
                   eos_ids=tuple(d.eos_token_ids), max_model_len=d.max_model_len,
                   tier_host_bytes=min(r.tier_host_bytes for r in group),
                   tier_disk_bytes=min(r.tier_disk_bytes for r in group),
                   block_bytes=max(r.block_bytes for r in group), state_bytes=max(r.state_bytes for r in group),
                   device=d.settings.get("device", "cpu"),
                   step_budget=min(r.max_num_batched_tokens for r in group))

    def round_budget(self, given: int | None) -> int:
        """The tokens one round may carry: the scheduler's --max-num-batched-tokens when given, else the ranks'. A
        larger budget than the ranks' is refused (ValueError): they sized their activation memory and warmed up
        their kernels for theirs, and a bigger round could run out of memory or compile on a user's request."""
        ranks = self.step_budget or step_budget(None, self.device)  # ranks that do not say: their device's default
        if given is None:
            return ranks
        if given > ranks:
            raise ValueError(f"--max-num-batched-tokens {given} is more than the {ranks} the ranks sized their memory "
                             f"for: give the ranks the same --max-num-batched-tokens, or the scheduler at most {ranks}")
        return given


def describe_differences(name_a: str, a: rank_pb2.DescribeReply, name_b: str, b: rank_pb2.DescribeReply) -> str:
    """Two Describe replies' fingerprints and every setting that differs, by name."""
    keys = sorted(k for k in set(a.settings) | set(b.settings) if a.settings.get(k) != b.settings.get(k))
    what = ", ".join(f"{k}: {name_a}={a.settings.get(k)!r} {name_b}={b.settings.get(k)!r}" for k in keys)
    return f"fingerprint {b.fingerprint[:12]}… vs {name_a} {a.fingerprint[:12]}…{'; ' + what if what else ''}"
