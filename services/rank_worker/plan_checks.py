"""A StepPlan checked whole before anything runs: shapes, dtypes, ranges, and counts bounded by what this rank holds.

Every rank checks the same plan the same way, so they all refuse it together (PlanError) instead of one entering
the collective alone; and since counts are bounded by the cache, no plan makes a rank allocate or loop without end.
The functions here only read the plan (and the state they are handed); the executor runs what they return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple

import torch

from kernels.penalties import Penalties
from kernels.sampling import SamplingParams
from kernels.sampling_rules import (FREQUENCY_PENALTY, LOGIT_BIAS, MIN_P, PRESENCE_PENALTY, PROMPT_LOGPROBS,
                                    REPETITION_PENALTY, TEMPERATURE, TOP_K, TOP_LOGPROBS, TOP_P)
from model.vision import VisionConfig
from services.common.shared_flags import MAX_SCHEDULER_STEPS
from services.common.tensors import from_proto
from services.rank_worker.kv_tiers import TierStore
from twinspark.v1 import rank_pb2
from twinspark.v1.rank_pb2 import StepPlan

# A token id of StepPlan.token_ids meaning "the token this rank sampled last for this sequence's slot".
PENDING_TOKEN = -1
MAX_KEY = 64  # bytes of a tier key or an image digest (the scheduler's keys are 16, digests 32)

_INT_DTYPES = (torch.int32, torch.int64)


class PlanError(ValueError):
    """The plan is malformed or addresses memory this rank does not have."""


@dataclass(frozen=True)
class Limits:
    """What this rank holds; a plan's ids and counts are checked against it."""

    num_blocks: int
    block_size: int
    num_slots: int
    vocab_size: int
    max_positions: int


@dataclass
class Sequences:
    """A plan's sequences, checked, on the host."""

    tokens: torch.Tensor  # int64 [N]; a pending row holds 0 here (its token is filled in on the device)
    starts: torch.Tensor  # int64 [B]
    lengths: torch.Tensor  # int64 [B]
    slots: torch.Tensor  # int64 [B]
    tables: torch.Tensor  # int64 [B, W]
    verify: list[bool] | None
    prompt: list[bool] | None
    pending: list[int]  # rows whose token is their slot's last sample (PENDING_TOKEN) ...
    pending_slots: list[int]  # ... and those slots
    rows: torch.Tensor  # int64 [R] sample rows
    params: SamplingParams  # per sample row


class ScoreRows(NamedTuple):
    """Prompt rows whose logits are scored (prompt logprobs), validated: rows and next ids int64 [S], top k."""
    rows: torch.Tensor
    next_ids: torch.Tensor
    k: int


class ImagePart(NamedTuple):
    """One image of a plan, validated: its embeddings [first, first + count) go to packed rows row.."""
    row: int
    first: int
    count: int
    pixels: torch.Tensor
    grid: tuple[int, int, int]
    digest: bytes  # the request's sha256 of the pixels (empty: not known, the tower's output is not kept)


# ------------------------------------------------------------------------------------------------ plan tensors
def _tensor(msg, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Unpack a plan tensor whose wire dtype is of `dtype`'s kind (integers for ids, float32 for sampling values:
    a float token id or an integer temperature is a malformed plan, not something to round)."""
    try:
        t = from_proto(msg)
    except ValueError as exc:
        raise PlanError(f"{name}: {exc}") from exc
    ok = t.dtype in _INT_DTYPES if dtype in _INT_DTYPES else t.dtype == torch.float32
    if not ok:
        raise PlanError(f"{name}: {msg.dtype} is not a valid dtype here (expected "
                        f"{'int32 or int64' if dtype in _INT_DTYPES else 'float32'})")
    return t.to(dtype)


def _vec(msg, name: str, dtype: torch.dtype, length: int | None = None) -> torch.Tensor:
    t = _tensor(msg, name, dtype)
    if t.dim() != 1 or (length is not None and t.numel() != length):
        raise PlanError(f"{name}: expected a vector of {length if length is not None else 'n'} values, got {list(t.shape)}")
    return t


def _matrix(msg, name: str, dtype: torch.dtype, rows: int) -> torch.Tensor:
    t = _tensor(msg, name, dtype)
    if t.dim() != 2 or t.shape[0] != rows:
        raise PlanError(f"{name}: expected [{rows}, n], got {list(t.shape)}")
    return t


def _given(plan: StepPlan, name: str) -> bool:
    """Whether the plan sets a per-row tensor (an empty one means the same as none)."""
    return plan.HasField(name) and bool(getattr(plan, name).shape) and bool(getattr(plan, name).shape[0])


def _flags(plan: StepPlan, name: str, n: int) -> list[bool] | None:
    """A per-sequence int32 flag vector of the plan; None when the plan leaves it empty."""
    if not _given(plan, name):
        return None
    flags = _vec(getattr(plan, name), name, torch.int64, n)
    if bool(((flags != 0) & (flags != 1)).any()):
        raise PlanError(f"{name} flags must be 0 or 1")
    return [bool(f) for f in flags.tolist()]


def _id_lists(msg, name: str, rows: int, vocab: int) -> torch.Tensor:
    """int64 [rows, n] token ids padded with -1, distinct within each row (a scatter of repeated ids would depend
    on its order on a GPU)."""
    t = _matrix(msg, name, torch.int64, rows)
    if t.shape[1] > vocab:
        raise PlanError(f"{name}: {t.shape[1]} ids per row for a vocabulary of {vocab}")
    if bool((t < -1).any()) or bool((t >= vocab).any()):
        raise PlanError(f"{name}: ids must be in [0, {vocab}) or -1 (padding)")
    s = t.sort(dim=1).values
    if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
        raise PlanError(f"{name}: an id is listed twice in one row")
    return t


# ------------------------------------------------------------------------------------------------- sequences
def has_sequences(plan: StepPlan) -> bool:
    return _given(plan, "lengths")


def check_counts(tokens: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor, limits: Limits) -> None:
    """Sizes no honest plan exceeds: rows that fit the cache, tables no wider than the cache, and at most one sample
    per row."""
    capacity = limits.num_blocks * limits.block_size
    if tokens.numel() > capacity:
        raise PlanError(f"{tokens.numel()} token rows exceed the cache's {capacity} positions")
    if tables.shape[1] > limits.num_blocks:
        raise PlanError(f"block tables of width {tables.shape[1]} exceed the cache's {limits.num_blocks} blocks")
    if rows.numel() > tokens.numel():
        raise PlanError(f"{rows.numel()} sample rows for {tokens.numel()} token rows")


def check_positions(starts: torch.Tensor, lengths: torch.Tensor, max_positions: int) -> None:
    """Every row inside the model's window (starts first: near the int64 limit, starts + lengths would wrap)."""
    if bool((starts > max_positions).any()) or bool(((starts + lengths) > max_positions).any()):
        raise PlanError(f"a sequence runs past the model's {max_positions} positions")


def check_sampling(params: SamplingParams) -> None:
    """The ranges the scheduler validates requests against (kernels/sampling_rules.py)."""
    for rule, t in ((TEMPERATURE, params.temperature), (TOP_P, params.top_p), (TOP_K, params.top_k),
                    (MIN_P, params.min_p)):
        if not rule.holds(t):
            raise PlanError(f"{rule.name} must be {rule}")


def pending_rows(tokens: torch.Tensor, starts: list[int], lengths: list[int], slots: list[int],
                 prompt: list[bool] | None, verify: list[bool] | None,
                 slot_end: Mapping[int, int]) -> tuple[list[int], list[int]]:
    """The rows holding PENDING_TOKEN and their slots. A scheduler that plans round n+1 before round n's result
    has come back sends a decode step whose input is the token this rank sampled last for the sequence's slot
    (rounds run in order on a stream, so that token is on the device by then). It must continue exactly where
    the slot's last sampling round ended (`slot_end`: slot -> the position after that round's rows): after a
    refused round it does not, and every rank refuses the plan."""
    if not bool((tokens == PENDING_TOKEN).any()):
        return [], []
    rows: list[int] = []
    pending_slots: list[int] = []
    row = 0
    for s, (start, n, slot) in enumerate(zip(starts, lengths, slots)):
        if bool((tokens[row : row + n] == PENDING_TOKEN).any()):
            if n != 1 or (prompt is not None and prompt[s]) or (verify is not None and verify[s]):
                raise PlanError(f"sequence {s}: a pending token id is only valid as a decode step's one row")
            if slot_end.get(slot) != start:
                raise PlanError(f"sequence {s}: a pending token id at position {start}, but slot {slot}'s last "
                                f"sampling round ended at {slot_end.get(slot)}")
            rows.append(row)
            pending_slots.append(slot)
        row += n
    return rows, pending_slots


def _check_ids(tokens: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
               tables: torch.Tensor, limits: Limits) -> None:
    """Token ids, slots, block ids and positions inside what this rank holds."""
    if bool((tokens < 0).any()) or bool((tokens >= limits.vocab_size).any()):
        raise PlanError("a token id is outside the vocabulary")
    if bool((slots < 0).any()) or bool((slots >= limits.num_slots).any()) or \
            len(set(slots.tolist())) != slots.numel():
        raise PlanError(f"slots must be distinct and in [0, {limits.num_slots})")
    if bool((tables < 0).any()) or bool((tables >= limits.num_blocks).any()):
        raise PlanError(f"block ids must be in [0, {limits.num_blocks})")
    if bool(((starts + lengths) > tables.shape[1] * limits.block_size).any()):
        raise PlanError("a sequence runs past the end of its block table")
    check_positions(starts, lengths, limits.max_positions)


def _sample_rows(plan: StepPlan, tokens: torch.Tensor, tables: torch.Tensor,
                 limits: Limits) -> tuple[torch.Tensor, SamplingParams]:
    """The sample rows and their sampling settings."""
    rows = _vec(plan.sample_rows, "sample_rows", torch.int64)
    check_counts(tokens, tables, rows, limits)
    r = rows.numel()
    if bool((rows < 0).any()) or bool((rows >= tokens.numel()).any()):
        raise PlanError("a sample row is outside the batch")
    params = SamplingParams(
        temperature=_vec(plan.temperature, "temperature", torch.float32, r),
        top_k=_vec(plan.top_k, "top_k", torch.int64, r),
        top_p=_vec(plan.top_p, "top_p", torch.float32, r),
        min_p=_vec(plan.min_p, "min_p", torch.float32, r),
        seed=_vec(plan.seed, "seed", torch.int64, r),
    )
    check_sampling(params)  # on host tensors: checks on device tensors would each wait for the GPU
    return rows, params


def _check_verify_rows(verify: list[bool] | None, lengths: list[int], rows: torch.Tensor) -> None:
    """Every row of a verify window is sampled: the drafts are accepted by comparing them with those samples."""
    if verify is None:
        return
    wanted = set(rows.tolist())
    offset = 0
    for s, n in enumerate(lengths):
        if verify[s] and not all(offset + i in wanted for i in range(n)):
            raise PlanError(f"sequence {s} is a verify window but not all its rows are sample rows")
        offset += n


def check_sequences(plan: StepPlan, limits: Limits, slot_end: Mapping[int, int]) -> Sequences:
    """The plan's sequences, sample rows and sampling settings, checked (the plan has sequences)."""
    tokens = _vec(plan.token_ids, "token_ids", torch.int64)
    lengths = _vec(plan.lengths, "lengths", torch.int64)
    b = lengths.numel()
    starts = _vec(plan.starts, "starts", torch.int64, b)
    slots = _vec(plan.slots, "slots", torch.int64, b)
    tables = _tensor(plan.block_tables, "block_tables", torch.int64)
    if b == 0 or tables.dim() != 2 or tables.shape[0] != b:
        raise PlanError(f"block_tables must be [{b}, W] for {b} sequences, got {list(tables.shape)}")
    if int(lengths.sum()) != tokens.numel() or bool((lengths < 1).any()) or bool((starts < 0).any()):
        raise PlanError("lengths must be >= 1 and sum to the number of token ids; starts must be >= 0")
    verify = _flags(plan, "verify", b)
    prompt = _flags(plan, "prompt", b)
    if verify is not None and prompt is not None and any(v and p for v, p in zip(verify, prompt)):
        raise PlanError("a sequence cannot be both a verify window and a prompt chunk")
    pending, pending_slots = pending_rows(tokens, starts.tolist(), lengths.tolist(), slots.tolist(), prompt, verify,
                                          slot_end)
    if pending:
        tokens = tokens.clone()
        tokens[pending] = 0  # filled on the device
    _check_ids(tokens, starts, lengths, slots, tables, limits)
    rows, params = _sample_rows(plan, tokens, tables, limits)
    _check_verify_rows(verify, lengths.tolist(), rows)
    return Sequences(tokens, starts, lengths, slots, tables, verify, prompt, pending, pending_slots, rows, params)


# A plan's decode steps at most (StepPlan.steps): bounds the work one round queues.
MAX_STEPS = MAX_SCHEDULER_STEPS


def decode_steps(plan: StepPlan, seqs: Sequences, limits: Limits) -> int:
    """How many decode steps the plan runs (StepPlan.steps; 0 means 1), checked: several only for a round of
    one-row decode steps that are all sample rows, carrying nothing that reads a step's own samples (masks,
    penalties) or wants more than the samples (score rows, hidden states, images); each sequence's block table and
    the model's window must hold its last step's row."""
    n = plan.steps or 1
    if n == 1:
        return 1
    if n > MAX_STEPS:
        raise PlanError(f"{n} decode steps: at most {MAX_STEPS} per plan")
    b = seqs.lengths.numel()
    if bool((seqs.lengths != 1).any()) or any(seqs.prompt or []) or any(seqs.verify or []):
        raise PlanError("a multi-step plan holds only one-row decode steps")
    if seqs.rows.tolist() != list(range(b)):
        raise PlanError("in a multi-step plan every sequence's row is a sample row, in order")
    extras = [name for name in ("mask_index", "score_rows") if _given(plan, name)]
    extras += ["penalties"] if plan.HasField("penalties") and _given(plan.penalties, "rows") else []
    extras += [name for name in ("want_hidden", "hidden_layers", "images") if getattr(plan, name)]
    if extras:
        raise PlanError(f"a multi-step plan cannot carry {', '.join(extras)}")
    if bool(((seqs.starts + n) > seqs.tables.shape[1] * limits.block_size).any()):
        raise PlanError(f"a sequence's step {n - 1} runs past the end of its block table")
    check_positions(seqs.starts, torch.full_like(seqs.starts, n), limits.max_positions)
    return n


# ----------------------------------------------------------------------------------- per sample row extras
def row_masks(plan: StepPlan, r: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The plan's grammar masks, validated: (mask_index int64 [R], bitmask int32 [M, W]); None when unmasked."""
    if not _given(plan, "mask_index"):
        return None
    index = _vec(plan.mask_index, "mask_index", torch.int64, r)
    try:
        bitmask = from_proto(plan.bitmask)
    except ValueError as exc:
        raise PlanError(f"bitmask: {exc}") from exc
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise PlanError(f"bitmask must be int32 [M, W], got {bitmask.dtype}{list(bitmask.shape)}")
    if bool((index >= bitmask.shape[0]).any()) or bool((index < -1).any()):
        raise PlanError(f"mask_index must be in [-1, {bitmask.shape[0]})")
    return index, bitmask


def logprobs_k(plan: StepPlan, r: int) -> torch.Tensor | None:
    """int64 [R]: per sample row -1 (no logprobs) or the number of top logprobs wanted; None when none asks."""
    if not _given(plan, "logprobs_k"):
        return None
    k = _vec(plan.logprobs_k, "logprobs_k", torch.int64, r)
    if not TOP_LOGPROBS.holds(k[k != -1]):  # -1: no logprobs for that row
        raise PlanError(f"logprobs_k must be -1 or {TOP_LOGPROBS}")
    return k if bool((k >= 0).any()) else None


def score_rows(plan: StepPlan, prompt: list[bool] | None, lengths: list[int], vocab: int) -> ScoreRows | None:
    """The plan's prompt rows to score (StepPlan.score_rows / score_ids / score_k), validated; None when there are
    none. Each is a row of a prompt chunk, at most once; so a plan scores at most its own rows."""
    if not _given(plan, "score_rows"):
        return None
    tokens = sum(lengths)
    rows = _vec(plan.score_rows, "score_rows", torch.int64)
    next_ids = _vec(plan.score_ids, "score_ids", torch.int64, rows.numel())
    if bool((rows < 0).any()) or bool((rows >= tokens).any()) or rows.unique().numel() != rows.numel():
        raise PlanError(f"score_rows must be distinct rows in [0, {tokens})")
    if bool((next_ids < 0).any()) or bool((next_ids >= vocab).any()):
        raise PlanError("a score id is outside the vocabulary")
    if not PROMPT_LOGPROBS.holds(plan.score_k):
        raise PlanError(f"score_k must be {PROMPT_LOGPROBS}")
    # A scored row belongs to a sequence the plan flags as a prompt chunk: its logits are a prefill's.
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    if prompt is None or not all(prompt[s] for s in seq_of[rows].tolist()):
        raise PlanError("a score row is not a row of a sequence flagged as a prompt chunk")
    return ScoreRows(rows, next_ids, int(plan.score_k))


def row_penalties(plan: StepPlan, r: int, vocab: int, max_positions: int) -> Penalties | None:
    """The plan's penalties (StepPlan.penalties), validated, on the host; None when no row uses any. Ranges are
    the gateway's and the scheduler's (kernels/sampling_rules.py)."""
    if not plan.HasField("penalties"):
        return None
    p = plan.penalties
    rows = _vec(p.rows, "penalties.rows", torch.int64)
    q = rows.numel()
    if q == 0:
        return None
    if bool((rows < 0).any()) or bool((rows >= r).any()) or bool((rows[1:] <= rows[:-1]).any()):
        raise PlanError(f"penalties.rows must be ascending sample rows in [0, {r})")
    presence = _vec(p.presence, "penalties.presence", torch.float32, q)
    frequency = _vec(p.frequency, "penalties.frequency", torch.float32, q)
    repetition = _vec(p.repetition, "penalties.repetition", torch.float32, q)
    for rule, t in ((PRESENCE_PENALTY, presence), (FREQUENCY_PENALTY, frequency), (REPETITION_PENALTY, repetition)):
        if not rule.holds(t):
            raise PlanError(f"{rule.name} must be {rule}")
    seen = _id_lists(p.seen_ids, "penalties.seen_ids", q, vocab)
    counts = _matrix(p.seen_counts, "penalties.seen_counts", torch.int64, q)
    if counts.shape != seen.shape or bool((counts < 0).any()) or bool((counts > max_positions).any()) \
            or bool(((seen < 0) & (counts != 0)).any()):
        raise PlanError(f"penalties.seen_counts must be [Q, P] like seen_ids, in [0, {max_positions}], 0 at padding")
    bias_ids = _id_lists(p.bias_ids, "penalties.bias_ids", q, vocab)
    bias = _matrix(p.bias_values, "penalties.bias_values", torch.float32, q)
    if bias.shape != bias_ids.shape or not LOGIT_BIAS.holds(bias):
        raise PlanError(f"penalties.bias_values must be [Q, B] like bias_ids, {LOGIT_BIAS}")
    banned = _id_lists(p.banned_ids, "penalties.banned_ids", q, vocab)
    return Penalties(rows, presence, frequency, repetition, seen, counts, bias_ids, bias, banned)


# ------------------------------------------------------------------------------------ memory moves and images
def state_copies(plan: StepPlan, num_slots: int) -> list[tuple[int, int]]:
    """The plan's (source slot, target slot) KDA state copies, validated; an empty tensor means none."""
    if not plan.HasField("state_copies") or not plan.state_copies.dtype:
        return []
    t = _tensor(plan.state_copies, "state_copies", torch.int64)
    if t.numel() == 0:
        return []
    if t.dim() != 2 or t.shape[1] != 2:
        raise PlanError(f"state_copies must be [K, 2] (source slot, target slot), got {list(t.shape)}")
    if t.shape[0] > 2 * num_slots:  # a take and a resume per slot at most
        raise PlanError(f"{t.shape[0]} state copies for {num_slots} slots")
    if bool((t < 0).any()) or bool((t >= num_slots).any()):
        raise PlanError(f"state_copies: slots must be in [0, {num_slots})")
    return [(int(a), int(b)) for a, b in t.tolist()]


def hidden_layers(plan: StepPlan, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs the plan wants back (DFlash drafts), validated; () for none."""
    layers = tuple(plan.hidden_layers)
    if len(layers) > num_layers or any(not 0 <= i < num_layers for i in layers):
        raise PlanError(f"hidden_layers {list(layers)[:16]}: at most {num_layers} layers in [0, {num_layers})")
    return layers


def tier_moves(plan: StepPlan, tiers: TierStore | None,
               limits: Limits) -> list[tuple[rank_pb2.TierMove, list[int]]]:
    """The plan's KV tier moves with their pool blocks, validated (nothing runs before every move checks out)."""
    out = []
    for m in plan.tier_moves:
        if tiers is None:
            raise PlanError("a KV tier move, but this rank has no tiers (--kv-host-bytes / --kv-disk-dir)")
        if (m.to_disk or m.kind == rank_pb2.TIER_SPILL) and tiers.dir is None:
            raise PlanError("a disk tier move, but this rank has no --kv-disk-dir")
        keys = list(m.block_keys) + ([m.state_key] if m.state_key else [])
        if any(not 0 < len(k) <= MAX_KEY for k in keys):
            raise PlanError(f"tier keys must be 1..{MAX_KEY} bytes")
        blocks: list[int] = []
        if m.kind in (rank_pb2.TIER_SAVE, rank_pb2.TIER_LOAD):
            blocks = _vec(m.blocks, "tier_moves.blocks", torch.int64, len(m.block_keys)).tolist() \
                if m.block_keys else []
            if any(not 0 <= b < limits.num_blocks for b in blocks):
                raise PlanError(f"tier_moves: blocks must be in [0, {limits.num_blocks})")
            if m.state_key and not 0 <= m.slot < limits.num_slots:
                raise PlanError(f"tier_moves: slot must be in [0, {limits.num_slots})")
        out.append((m, blocks))
    return out


def image_rows(plan: StepPlan, n_rows: int, vision: VisionConfig | None, can_encode: bool) -> list[ImagePart]:
    """The plan's images, validated. vision: the checkpoint's tower geometry (None: a text-only checkpoint);
    can_encode: False on a rank 0 that loaded no tower (it alone runs it)."""
    if not plan.images:
        return []
    if vision is None or not can_encode:
        raise PlanError("images, but this checkpoint has no vision tower")
    out = []
    for i, im in enumerate(plan.images):
        try:
            pixels = from_proto(im.pixel_values)
        except ValueError as exc:
            raise PlanError(f"images[{i}].pixel_values: {exc}") from exc
        t, h, w = _vec(im.grid_thw, f"images[{i}].grid_thw", torch.int64, 3).tolist()
        m = vision.spatial_merge_size
        if min(t, h, w) < 1 or h % m or w % m:
            raise PlanError(f"images[{i}]: grid {t}x{h}x{w} is not whole {m}x{m} merge blocks")
        if pixels.dtype != torch.float32 or list(pixels.shape) != [t * h * w, vision.patch_dim]:
            raise PlanError(f"images[{i}]: pixel_values must be float32 [{t * h * w}, {vision.patch_dim}]")
        tokens = t * h * w // m ** 2
        if im.count < 1 or im.first < 0 or im.first + im.count > tokens or im.row < 0 \
                or im.row + im.count > n_rows:
            raise PlanError(f"images[{i}]: embeddings [{im.first}, {im.first + im.count}) of {tokens} at rows "
                            f"{im.row}.. do not fit")
        if len(im.digest) > MAX_KEY:
            raise PlanError(f"images[{i}].digest: at most {MAX_KEY} bytes")
        out.append(ImagePart(im.row, im.first, im.count, pixels, (t, h, w), bytes(im.digest)))
    return out


def tier_moves_only(plan: StepPlan) -> None:
    """A plan without sequences: it must carry tier moves (a load a request waits for; saving the pool at
    shutdown), and no token ids."""
    if not plan.tier_moves:
        raise PlanError("a plan without sequences must carry tier moves")
    if _given(plan, "token_ids"):
        raise PlanError("token ids without sequences")
