"""A STAND-IN rank worker for scheduler tests — a real gRPC `RankWorker` server with a fake, deterministic forward.

Not the model. It keeps what a real rank keeps, in the shape a real rank keeps it:
- a paged token store `[num_blocks, block_size]` written through each sequence's block table (the "KV cache");
- one "KDA state" per slot: (position, running sha256 of every token fed to that slot), reset when start == 0,
  and copied slot to slot by the plan's `state_copies` before the round (prefix snapshots: a wrong or stale
  snapshot makes the state disagree with the tokens read back through the block table, and the stand-in refuses);

and samples, for a row at position p:  token = standin_token(tokens 0..p read back through the block table, seed)
(`temperature == 0` ignores the seed). So a wrong block table, a wrong start, a chunking or reordering bug, two
requests sharing a block or a slot, or a stale block all change the output (or make the stand-in refuse the round,
which fails the test loudly). It checks round numbers and checksums like a real rank, and can be told to slow down
or to fail at a given round.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import grpc
import numpy as np

from services.common.internal_auth import server_interceptors
from services.common.plan_checksum import plan_checksum
from services.common.tensors import from_proto, to_proto
from twinspark.v1 import rank_pb2, rank_pb2_grpc


def _i32(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def standin_token(prefix: Sequence[int], seed: int, temperature: float, vocab: int) -> int:
    """The stand-in's "forward + sample": the token at position len(prefix), given every token before it."""
    h = hashlib.sha256(_i32(prefix))
    h.update(struct.pack("<Q", len(prefix)))  # the position of the token being drawn
    if temperature > 0:
        h.update(struct.pack("<Q", seed & (2**64 - 1)))
    return int.from_bytes(h.digest()[:8], "little") % vocab


def standin_generate(prompt: Sequence[int], max_tokens: int, *, vocab: int, seed: int = 0, temperature: float = 0.0,
                     eos: Sequence[int] = (), stop_ids: Sequence[int] = ()) -> tuple[list[int], str, int]:
    """What one request alone must produce: (tokens, "stop" | "length", stopping id or -1)."""
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        t = standin_token(seq, seed, temperature, vocab)
        seq.append(t)
        out.append(t)
        if t in eos or t in stop_ids:
            return out, "stop", t
    return out, "length", -1


class StandinRefusal(RuntimeError):
    """A plan the stand-in refuses before running anything, as a real rank refuses a malformed one."""


class StandinError(RuntimeError):
    pass


@dataclass
class RoundLog:
    round: int
    seqs: list[tuple[str, int, int, bool]]  # (request id, start, length, sampled)


@dataclass
class StandinRank(rank_pb2_grpc.RankWorkerServicer):
    rank: int = 0
    world: int = 1
    num_blocks: int = 64
    block_size: int = 4
    num_slots: int = 8
    vocab: int = 1000
    eos: tuple[int, ...] = ()
    max_model_len: int = 256
    fingerprint: str = "standin-fingerprint"
    step_delay_s: float = 0.0
    fail_at_round: int | None = None
    port: int = 0  # 0: any free port
    # "stop": the server dies; "error": answers StepResult.error; "raise": stream breaks; "refuse": answers a refusal
    # of a malformed plan (StepResult.refused) and goes on serving, as a real rank does
    fail_mode: str = "stop"
    # Sample under the plan's masks (grammar, forced end of thinking) as a real rank does: a masked row draws among the
    # tokens its mask allows. Off (the default): masks are ignored, so tests can see what a rank that skips them does.
    apply_masks: bool = False
    token: str | None = None  # the internal token its server requires (None: none)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # per stand-in, like a rank process start
    rounds: list[RoundLog] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    copies: list[list[tuple[int, int]]] = field(default_factory=list)  # state copies per round
    steps: list[int] = field(default_factory=list)  # decode steps of every plan with sequences (StepPlan.steps)

    def __post_init__(self) -> None:
        self.store = np.full((self.num_blocks, self.block_size), -1, dtype=np.int64)
        self.slot_pos = [0] * self.num_slots
        self.last_sampled: dict[int, int] = {}  # slot -> its last sampled token (what a pending token id means)
        self.pending_filled = 0  # decode rows sent before the token they continue from came back (pipelined)
        self.penalties: list[rank_pb2.RowPenalties] = []  # StepPlan.penalties of every plan that had them (unapplied)
        self.slot_hash = [hashlib.sha256() for _ in range(self.num_slots)]
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self.server = grpc.aio.server(interceptors=server_interceptors(self.token, f"stand-in rank{self.rank}",
                                                                       aio=True))
        rank_pb2_grpc.add_RankWorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    # -- RPCs -----------------------------------------------------------------------------------------------------
    async def Describe(self, request, context) -> rank_pb2.DescribeReply:
        return rank_pb2.DescribeReply(
            rank=self.rank, world=self.world, fingerprint=self.fingerprint, settings={"standin": self.fingerprint},
            num_blocks=self.num_blocks, block_size=self.block_size, num_slots=self.num_slots, vocab_size=self.vocab,
            eos_token_ids=list(self.eos), max_model_len=self.max_model_len, model="standin",
            instance_id=self.instance_id)

    async def Step(self, request_iterator, context):
        expected = 1
        async for plan in request_iterator:
            if plan.round == self.fail_at_round:
                if self.fail_mode == "error":
                    yield rank_pb2.StepResult(round=plan.round, rank=self.rank, error="stand-in: injected failure")
                    return
                if self.fail_mode == "raise":
                    raise RuntimeError("stand-in: injected stream failure")
                if self.fail_mode == "refuse":
                    expected += 1
                    yield rank_pb2.StepResult(round=plan.round, rank=self.rank, error="stand-in: refused plan",
                                              refused=True)
                    continue
                asyncio.ensure_future(self.stop())  # "stop": the whole rank goes away mid-round
                await asyncio.sleep(30)
                return
            try:
                if plan.round != expected:
                    raise StandinError(f"round {plan.round} arrived, expected {expected}")
                if plan.checksum != plan_checksum(plan):
                    raise StandinError(f"round {plan.round}: checksum mismatch")
                sampled = self._execute(plan)
            except StandinRefusal as exc:
                expected += 1
                yield rank_pb2.StepResult(round=plan.round, rank=self.rank, error=str(exc), refused=True)
                continue
            except StandinError as exc:
                self.errors.append(str(exc))
                yield rank_pb2.StepResult(round=plan.round, rank=self.rank, error=str(exc))
                return
            expected += 1
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            yield rank_pb2.StepResult(round=plan.round, rank=self.rank, sampled=to_proto(sampled))

    # -- the fake forward -----------------------------------------------------------------------------------------
    def _execute(self, plan: rank_pb2.StepPlan) -> list[int]:
        """A multi-step plan (StepPlan.steps) runs as that many one-step plans, each a pending decode step one
        position on; its samples come back row after row, as a rank returns them."""
        self.steps.append(max(1, plan.steps))
        if plan.steps <= 1:
            return self._execute_one(plan)
        lengths = from_proto(plan.lengths).tolist()
        rows = from_proto(plan.sample_rows).tolist()
        if set(lengths) != {1} or rows != list(range(len(lengths))) or plan.HasField("mask_index"):
            raise StandinRefusal(f"round {plan.round}: a multi-step plan of other than plain decode steps")
        per_step = []
        for i in range(plan.steps):
            one = rank_pb2.StepPlan()
            one.CopyFrom(plan)
            one.steps = 0
            one.starts.CopyFrom(to_proto([s + i for s in from_proto(plan.starts).tolist()]))
            if i:
                one.token_ids.CopyFrom(to_proto([-1] * len(lengths)))
                one.ClearField("state_copies")
            per_step.append(self._execute_one(one))
        return [per_step[i][r] for r in range(len(rows)) for i in range(plan.steps)]

    def _execute_one(self, plan: rank_pb2.StepPlan) -> list[int]:
        if plan.HasField("penalties"):
            self.penalties.append(plan.penalties)
        tokens = from_proto(plan.token_ids).tolist()
        starts = from_proto(plan.starts).tolist()
        lengths = from_proto(plan.lengths).tolist()
        slots = from_proto(plan.slots).tolist()
        tables = from_proto(plan.block_tables).tolist()
        rows = from_proto(plan.sample_rows).tolist()
        temps = from_proto(plan.temperature).tolist()
        seeds = from_proto(plan.seed).tolist()
        b = len(lengths)
        if not (b and len(starts) == b == len(slots) == len(tables) == len(plan.request_ids)):
            raise StandinError(f"round {plan.round}: per-sequence tensors disagree on the number of sequences")
        if sum(lengths) != len(tokens) or min(lengths) < 1 or len(set(slots)) != b:
            raise StandinError(f"round {plan.round}: bad lengths or repeated slots")
        if not (len(rows) == len(temps) == len(seeds) == len(from_proto(plan.top_p).tolist())):
            raise StandinError(f"round {plan.round}: sampling tensors disagree with sample_rows")
        offset = 0
        for s in range(b):  # a pipelined decode step must continue where its slot's last round ended (as a rank)
            if -1 in tokens[offset : offset + lengths[s]] and self.slot_pos[slots[s]] != starts[s]:
                raise StandinRefusal(f"{plan.request_ids[s]}: a pending token id at {starts[s]}, slot {slots[s]} "
                                     f"is at {self.slot_pos[slots[s]]}")
            offset += lengths[s]
        copies: list[tuple[int, int]] = []
        if plan.HasField("state_copies") and plan.state_copies.dtype:
            t = from_proto(plan.state_copies)
            if t.numel() and (t.dim() != 2 or t.shape[1] != 2):
                raise StandinError(f"round {plan.round}: state_copies must be [K, 2], got {list(t.shape)}")
            copies = [(int(a), int(b)) for a, b in t.reshape(-1, 2).tolist()]
        for src, dst in copies:  # before the forward, in order
            if not (0 <= src < self.num_slots and 0 <= dst < self.num_slots):
                raise StandinError(f"round {plan.round}: state copy {src} -> {dst} outside the slots")
            self.slot_pos[dst], self.slot_hash[dst] = self.slot_pos[src], self.slot_hash[src].copy()
        self.copies.append(copies)
        row_at: list[tuple[int, int]] = []  # packed row -> (sequence, position)
        self.rounds.append(RoundLog(plan.round, []))
        for s in range(b):
            start, n, slot, table = starts[s], lengths[s], slots[s], tables[s]
            offset = len(row_at)
            if not 0 <= slot < self.num_slots:
                raise StandinError(f"slot {slot} out of range")
            if start == 0:
                self.slot_pos[slot], self.slot_hash[slot] = 0, hashlib.sha256()
            elif self.slot_pos[slot] != start:
                raise StandinError(f"{plan.request_ids[s]}: slot {slot} holds position {self.slot_pos[slot]}, "
                                   f"the plan starts at {start}")
            new = tokens[offset : offset + n]
            if -1 in new:  # a pipelined decode step: the token this rank sampled last for the slot
                if n != 1 or slot not in self.last_sampled:
                    raise StandinError(f"{plan.request_ids[s]}: a pending token id where none can be filled in")
                new = [self.last_sampled[slot]]
                self.pending_filled += 1
            for i, tok in enumerate(new):
                pos = start + i
                blk = self._block(table, pos, plan.request_ids[s])
                self.store[blk, pos % self.block_size] = tok
                row_at.append((s, pos))
            self.slot_pos[slot] += n
            self.slot_hash[slot].update(_i32(new))
            self.rounds[-1].seqs.append((plan.request_ids[s], start, n, offset + n - 1 in rows))
        masks = self._masks(plan, len(rows)) if self.apply_masks else [None] * len(rows)
        out = []
        for r, row in enumerate(rows):
            if not 0 <= row < len(row_at):
                raise StandinError(f"sample row {row} outside the batch")
            s, pos = row_at[row]
            prefix = [int(self.store[self._block(tables[s], p, plan.request_ids[s]), p % self.block_size])
                      for p in range(pos + 1)]
            if -1 in prefix:
                raise StandinError(f"{plan.request_ids[s]}: position {prefix.index(-1)} was never written")
            if pos == starts[s] + lengths[s] - 1 and \
                    hashlib.sha256(_i32(prefix)).digest() != self.slot_hash[slots[s]].digest():
                raise StandinError(f"{plan.request_ids[s]}: cache read back through the block table disagrees with "
                                   f"slot {slots[s]}'s state")
            token = standin_token(prefix, seeds[r], temps[r], self.vocab)
            allowed = masks[r]
            if allowed is not None:
                if not allowed:
                    raise StandinError(f"{plan.request_ids[s]}: sample row {r}'s mask allows no token")
                token = allowed[token % len(allowed)]
            out.append(token)
            if pos == starts[s] + lengths[s] - 1:
                self.last_sampled[slots[s]] = out[-1]
        return out

    def _masks(self, plan: rank_pb2.StepPlan, n_rows: int) -> list[list[int] | None]:
        """Per sample row: the ids its mask allows (ascending), None when unmasked."""
        if not plan.HasField("mask_index") or not plan.mask_index.dtype:
            return [None] * n_rows
        index = from_proto(plan.mask_index).tolist()
        words = from_proto(plan.bitmask).tolist()
        out: list[list[int] | None] = []
        for i in index:
            if i < 0:
                out.append(None)
                continue
            out.append([32 * j + b for j, w in enumerate(words[i]) for b in range(32)
                        if (w >> b) & 1 and 32 * j + b < self.vocab])
        return out

    def _block(self, table: list[int], pos: int, rid: str) -> int:
        i = pos // self.block_size
        if i >= len(table):
            raise StandinError(f"{rid}: position {pos} is past its block table ({len(table)} blocks)")
        blk = table[i]
        if not 0 <= blk < self.num_blocks:
            raise StandinError(f"{rid}: block {blk} out of range")
        return blk
