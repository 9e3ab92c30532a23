"""Flag defaults from the environment: every `--flag` of a service defaults from `TWINSPARK_<NAME>`."""

from __future__ import annotations

import os


def env(name: str, default: str | None = None) -> str | None:
    """The value of TWINSPARK_<name>, or `default` when unset."""
    return os.environ.get(f"TWINSPARK_{name}", default)
