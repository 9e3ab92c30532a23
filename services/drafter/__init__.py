"""The drafter: proposes draft tokens for the scheduler's verify windows (copy / mtp / dflash2 backends)."""
