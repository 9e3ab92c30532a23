"""One round's plan: which rows of which running requests go into the next forward, under a token budget.

Policy (continuous batching with chunked prefill):
1. Decode rows first, one per decoding request — each stream gets a token every round, whatever is prefilling.
   Normal priority before background; when the budget is smaller than the number of decoders, the ones served
   least recently go first, so nobody starves.
2. The rest of the budget goes to prefill chunks, FCFS (normal before background). A prompt longer than what is
   left is cut into chunks over several rounds; several short prompts can share a round. A chunk that does not
   finish its prompt always ends on the absolute 64-token KDA grid (docs/design.md §5.5), so drafts leave room for one
   whole grid chunk while a prompt waits, and the engine requires a budget of at least the running sequences + 64.

A sequence's `start` is the number of its tokens already in the cache; the rows to sample are the last row of each
sequence whose prompt is completely in the cache after this round (so every decode row, and the final chunk of a
prompt), unless the request generates nothing (max_tokens 0). A request that wants prompt logprobs has every row of
its prompt chunks whose next token is a prompt token scored (`StepPlan.score_rows`): the rows are the prefill's own,
nothing is computed twice.

Drafts: a decoder with drafts gets a verify window, rows [last token, d_1..d_k], every row a sample row, after every
decoder got its one row and while the budget lasts (drafts are cut to fit, never a decoder's own row). The rows
fit the request's reservation: k <= tokens still allowed - 1 (see `RoundScheduler.draft_wants`). The token sampled
at row position p is the token at position p + 1; ranks derive positions from starts/lengths, so nothing else
travels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.tensors import to_proto
from services.scheduler.penalties import PenaltySpec, row_penalties
from services.scheduler.prefix import KDA_CHUNK
from services.scheduler.request import Request
from twinspark.v1 import generate_pb2, rank_pb2


@dataclass
class PlannedSeq:
    req: Request
    start: int
    token_ids: list[int]
    sample: bool
    verify: bool = False  # token_ids = [last committed token, drafts...]; every row is sampled
    prompt: bool = False  # token_ids are prompt tokens (a prefill chunk): the ranks use prefill arithmetic
    # The tokens each sample row may produce (grammar, forced end of thinking: round_masks.py), None = any; None
    # for the whole sequence when no row is masked.
    masks: list[torch.Tensor | None] | None = None
    # Decode steps (StepPlan.steps, the same for every sequence of a round): a one-row decode step run `steps`
    # times, each step's row one position on, fed the token the step before sampled (decode_steps.py).
    steps: int = 1

    @property
    def num_drafts(self) -> int:
        return len(self.token_ids) - 1 if self.verify else 0

    @property
    def positions(self) -> int:
        """Cache positions the round writes for this sequence."""
        return len(self.token_ids) + self.steps - 1

    @property
    def samples(self) -> int:
        """Tokens the round samples for this sequence: every row of a verify window, one per step of a sampled
        sequence's last row."""
        if self.verify:
            return len(self.token_ids)
        return self.steps if self.sample else 0

    @property
    def scored(self) -> int:
        """How many of this chunk's rows are scored for prompt logprobs: each row whose next token is a prompt token
        (the prompt's last row predicts the first generated token: a sample row, or nothing)."""
        if not self.prompt or self.req.prompt_logprobs is None:
            return 0
        return max(0, min(self.start + len(self.token_ids), self.req.prompt_len - 1) - self.start)


def plan_round(running: list[Request], budget: int, drafts: dict[str, list[int]] | None = None,
               align: int = KDA_CHUNK) -> list[PlannedSeq]:
    """The sequences of the next round (decodes, then prefill chunks); empty when there is nothing to run.
    `drafts`: request id -> proposed drafts for its decode row (turns it into a verify window).

    A prefill chunk that does not finish its prompt ends at the request's next snapshot point when it reaches one
    (the prefix index takes the KDA state there; snapshot points are multiples of `align`), else at the last
    multiple of `align` it reaches; a prompt that cannot reach one this round waits. The chunked KDA kernel chunks
    relative to each call's start, so 64-aligned chunk boundaries give every prefill of a prompt the same chunk
    grid whatever the budget (a resumed prefill starts at a multiple of 64 too), which makes chunked, resumed and
    whole prefills bit-identical."""
    bg = generate_pb2.PRIORITY_BACKGROUND
    decoders = sorted((r for r in running if not r.prompt_left and r.wants_rows),
                      key=lambda r: (r.priority == bg, r.last_round, r.order))
    prefillers = sorted((r for r in running if r.prompt_left and r.ready), key=lambda r: (r.priority == bg, r.order))
    out: list[PlannedSeq] = []
    left = budget
    for r in decoders:
        if left < 1:
            break
        start, toks = r.next_rows(1)
        out.append(PlannedSeq(r, start, toks, sample=True))
        left -= 1
    # While a prompt waits, drafts leave room for one whole grid chunk (prefill must progress on the grid).
    reserve = align if prefillers and align > 0 else 0
    for s in out:
        d = (drafts or {}).get(s.req.id) or []
        d = d[: max(0, left - reserve)]
        if d:
            s.token_ids = s.token_ids + list(d)
            s.verify = True
            left -= len(d)
    for r in prefillers:
        if left < 1:
            break
        start = r.planned
        end = start + min(left, r.prompt_len - start)
        stop = next((p for p, _ in r.snap_points if p > start), None)
        if stop is not None and stop < end:
            end = stop
        elif end < r.prompt_len and align > 0:
            end = end // align * align
        if end <= start:
            continue  # no whole grid chunk fits what is left this round
        start, toks = r.next_rows(end - start)
        last = start + len(toks) >= r.prompt_len
        out.append(PlannedSeq(r, start, toks, sample=last and not r.replay and r.max_tokens > 0, prompt=True))
        left -= len(toks)
    return out


@dataclass
class _SampleRows:
    """The plan's per-sample-row columns, one entry per sample row in packed order (verify windows contribute
    every row, other sampled sequences their last)."""
    rows: list[int] = field(default_factory=list)  # the packed row each sample is taken from
    temperature: list[float] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    seed: list[int] = field(default_factory=list)
    logprobs_k: list[int] = field(default_factory=list)
    mask_index: list[int] = field(default_factory=list)  # per row: its mask in `bitmask`, -1 = any token
    bitmask: list[torch.Tensor] = field(default_factory=list)
    # (sample row, spec, its ids) of the rows that use penalties, logit_bias or min_tokens
    penalised: list[tuple[int, PenaltySpec, tuple[list[int], list[int], list[int]]]] = field(default_factory=list)

    def add(self, s: PlannedSeq, row0: int) -> None:
        """The sample rows of sequence `s`, whose first token is packed row `row0`."""
        sp = s.req.sampling
        rows = range(len(s.token_ids)) if s.verify else [len(s.token_ids) - 1]
        for j, r in enumerate(rows):
            pen = s.req.penalties
            if pen is not None:  # row j of a verify window follows drafts 1..j
                self.penalised.append((len(self.rows), pen.spec, pen.row(s.req, s.token_ids[1 : j + 1] if s.verify
                                                                          else [])))
            self.rows.append(row0 + r)
            mask = s.masks[j] if s.masks is not None else None
            self.mask_index.append(len(self.bitmask) if mask is not None else -1)
            if mask is not None:
                self.bitmask.append(mask)
            self.logprobs_k.append(s.req.logprobs_k)
            self.temperature.append(sp.temperature)
            self.top_p.append(sp.top_p)
            self.top_k.append(sp.top_k)
            self.min_p.append(sp.min_p)
            self.seed.append(sp.seed_i64)


@dataclass
class _ScoreRows:
    """The plan's prompt-logprob rows: which packed rows are scored, the prompt token each one predicts, and the
    largest number of top alternatives any request asked for (one k for the whole round)."""
    rows: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    k: int = 0

    def add(self, s: PlannedSeq, row0: int) -> None:
        """The scored rows of prompt chunk `s`, whose first token is packed row `row0`."""
        if s.scored:  # row i predicts prompt token start + i + 1
            self.rows += range(row0, row0 + s.scored)
            self.ids += s.req.tokens[s.start + 1 : s.start + 1 + s.scored]
            self.k = max(self.k, s.req.prompt_logprobs or 0)


def build_step_plan(seqs: list[PlannedSeq], block_size: int,
                    state_copies: list[tuple[int, int]] | None = None) -> rank_pb2.StepPlan:
    """The packed StepPlan for `seqs` (round and checksum are set by the sender); `state_copies` are the
    (source slot, target slot) KDA state copies the ranks do before the forward, in order."""
    token_ids: list[int] = []
    starts, lengths, slots, tables, verify, prompt = [], [], [], [], [], []
    sample, score = _SampleRows(), _ScoreRows()
    images: list[rank_pb2.ImageRows] = []
    for s in seqs:
        # Every row index below is relative to the packed batch: `len(token_ids)` is this sequence's first row.
        if s.prompt:
            images += _image_rows(s, len(token_ids))
        res = s.req.reservation
        assert res is not None, f"request {s.req.id} is planned without a reservation"
        if s.sample:
            sample.add(s, len(token_ids))
        score.add(s, len(token_ids))
        verify.append(1 if s.verify else 0)
        prompt.append(1 if s.prompt else 0)
        token_ids.extend(s.token_ids)
        starts.append(s.start)
        lengths.append(len(s.token_ids))
        slots.append(res.slot)
        # Only the blocks that cover positions this round touches (a full window's table would be ~8k ids per row).
        need = -(-(s.start + s.positions) // block_size)
        tables.append(res.blocks[:need])
    plan = rank_pb2.StepPlan(
        token_ids=to_proto(token_ids), starts=to_proto(starts), lengths=to_proto(lengths), slots=to_proto(slots),
        block_tables=to_proto(_padded_tables(tables)), sample_rows=to_proto(sample.rows),
        temperature=to_proto(sample.temperature, "float32"), top_p=to_proto(sample.top_p, "float32"),
        top_k=to_proto(sample.top_k), min_p=to_proto(sample.min_p, "float32"), seed=to_proto(sample.seed, "int64"),
        request_ids=[s.req.id for s in seqs], prompt=to_proto(prompt),
    )
    if state_copies:
        plan.state_copies.CopyFrom(to_proto(torch.tensor(state_copies, dtype=torch.int32).view(-1, 2)))
    if any(verify):
        plan.verify.CopyFrom(to_proto(verify))
    (steps,) = {s.steps for s in seqs}  # one round, one step count
    if steps > 1:
        plan.steps = steps
    _set_optional_rows(plan, sample, score)
    plan.images.extend(images)
    return plan


def _padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """The sequences' block tables as one [seqs, widest] int32 tensor: the plan carries a rectangle."""
    width = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), width, dtype=torch.int32)  # padded with 0, never read past a sequence's end
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return padded


def _set_optional_rows(plan: rank_pb2.StepPlan, sample: _SampleRows, score: _ScoreRows) -> None:
    """The plan's optional per-row fields, each set only when some row uses it: an unset field tells the ranks to
    skip that work (masking, logprobs, penalties, prompt scoring) for the whole round."""
    if sample.bitmask:
        # One width for all rows (the words past a mask's own are zero: those ids are not in its vocabulary).
        words = max(m.numel() for m in sample.bitmask)
        plan.mask_index.CopyFrom(to_proto(sample.mask_index))
        plan.bitmask.CopyFrom(to_proto(torch.stack([torch.nn.functional.pad(m, (0, words - m.numel()))
                                                    for m in sample.bitmask])))
    if any(k >= 0 for k in sample.logprobs_k):
        plan.logprobs_k.CopyFrom(to_proto(sample.logprobs_k))
    if sample.penalised:
        plan.penalties.CopyFrom(row_penalties(sample.penalised))
    if score.rows:
        plan.score_rows.CopyFrom(to_proto(score.rows))
        plan.score_ids.CopyFrom(to_proto(score.ids))
        plan.score_k = score.k


def _image_rows(s: PlannedSeq, row0: int) -> list[rank_pb2.ImageRows]:
    """The images whose placeholder tokens this prompt chunk holds (`row0`: its first packed row): each carries
    its pixels, and which of its embeddings go to which rows (a chunk may hold part of an image)."""
    lo, hi = s.start, s.start + len(s.token_ids)
    out = []
    for im in s.req.images:
        a, b = max(lo, im.offset), min(hi, im.offset + im.tokens)
        if a < b:
            out.append(rank_pb2.ImageRows(pixel_values=im.pixel_values, grid_thw=im.grid_thw, row=row0 + a - lo,
                                          first=a - im.offset, count=b - a, digest=im.digest))
    return out
