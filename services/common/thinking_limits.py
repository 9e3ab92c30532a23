"""Bounds on a thinking budget's ids (generate.proto `ThinkingBudget`), shared by the gateway, which builds them from
the server's --reasoning-budget-message, and the scheduler, which refuses a request past them."""

MAX_FORCED_IDS = 256  # the forced message's ids + the end-of-thinking id
MAX_END_IDS = 16
