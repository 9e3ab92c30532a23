"""A request's thinking budget: which budget applies, and what the scheduler is told to force when it runs out.

The budget, first given wins: `thinking_token_budget` (vLLM's name; Anthropic's `thinking.budget_tokens` maps to
it), else the budget of `reasoning_effort` (chat; Responses' `reasoning.effort`) from the server's table
(`--reasoning-effort-budgets`), else the server's `--reasoning-budget` (-1: none). It applies only when the reply
starts inside a think block; then `GenerateRequest.thinking` carries it with the ids to force once it is spent — the
`--reasoning-budget-message` text, then `</think>` — and the ids that end thinking on their own: `</think>`, and
`<tool_call>` when the reply's tool calls are parsed (a call opened while thinking ends it; the scheduler never
forces `</think>` into a call). The scheduler forces them by masks (services/scheduler/thinking.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.shared_flags import DEFAULT_EFFORT_BUDGETS, parse_effort_budgets
from services.common.thinking_limits import MAX_FORCED_IDS
from twinspark.v1 import generate_pb2

from .constraints import THINK_CLOSE
from .errors import bad_request
from .reply_parser import TOOL_OPEN
from .tokenizer import TextTokenizer

_EFFORT_ALIASES = {"max": "xhigh"}  # chat's "max" (the chat template's own top level)


@dataclass(frozen=True)
class ThinkingSettings:
    """The server's side (serve-gateway's --reasoning-* flags)."""

    default_budget: int | None = None  # a request that names no budget; None: unlimited
    message: str = ""  # forced before the end-of-thinking token
    efforts: dict[str, int | None] = field(default_factory=lambda: parse_effort_budgets(DEFAULT_EFFORT_BUDGETS))

    @classmethod
    def from_flags(cls, budget: int, message: str | None, efforts: str) -> "ThinkingSettings":
        return cls(default_budget=None if budget < 0 else budget, message=message or "",
                   efforts=parse_effort_budgets(efforts))

    def budget(self, explicit: int | None, effort: str | None) -> int | None:
        """The request's budget (None: unlimited)."""
        if explicit is not None:
            return explicit
        if effort is not None and effort != "none":
            return self.efforts[_EFFORT_ALIASES.get(effort, effort)]
        return self.default_budget


class ThinkingIds:
    """The checkpoint's think tags as ids, and the server's message, tokenized once."""

    def __init__(self, tokenizer: TextTokenizer, settings: ThinkingSettings) -> None:
        self.settings = settings
        self.close = tokenizer.token_to_id(THINK_CLOSE)
        self.tool_open = tokenizer.token_to_id(TOOL_OPEN)
        self.message = tokenizer.encode(settings.message) if settings.message else []
        if len(self.message) >= MAX_FORCED_IDS or {self.close, self.tool_open} & set(self.message):
            raise ValueError(f"--reasoning-budget-message must be under {MAX_FORCED_IDS} tokens and hold no "
                             f"{THINK_CLOSE} or {TOOL_OPEN} (it is forced before the end of thinking)")

    def end_ids(self, tools_parsed: bool) -> list[int]:
        """The ids that end thinking when generated: </think>, and a tool call's opening when calls are parsed."""
        ids = [self.close] if self.close is not None else []
        return ids + ([self.tool_open] if tools_parsed and self.tool_open is not None else [])

    def forced(self) -> list[int]:
        """What is forced once the budget is spent: the message, then </think>."""
        assert self.close is not None
        return [*self.message, self.close]

    def proto(self, budget: int, tools_parsed: bool, param: str) -> generate_pb2.ThinkingBudget:
        """The scheduler's part of a budget; `param`: the field that set it, for a checkpoint without the tag."""
        if self.close is None:
            raise bad_request(f"this checkpoint's tokenizer has no single {THINK_CLOSE} token, so a thinking budget "
                              "cannot be enforced", param=param)
        return generate_pb2.ThinkingBudget(budget=budget, forced_ids=self.forced(), end_ids=self.end_ids(tools_parsed))
