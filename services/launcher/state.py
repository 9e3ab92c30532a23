"""The state dir of a run: `up.json` (who is running, on which ports), `logs/`, and the supervisor's lock."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any

UP_JSON = "up.json"
LOCK = "supervisor.lock"


def default_state_dir() -> Path:
    """$TWINSPARK_STATE_DIR, else $XDG_STATE_HOME/twinspark, else ~/.local/state/twinspark."""
    if os.environ.get("TWINSPARK_STATE_DIR"):
        return Path(os.environ["TWINSPARK_STATE_DIR"]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser() / "twinspark"


def up_json_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / UP_JSON


def read_up(state_dir: str | Path) -> dict[str, Any] | None:
    """The recorded run, or None when there is none (or the file is unreadable)."""
    try:
        return json.loads(up_json_path(state_dir).read_text())
    except (OSError, ValueError):
        return None


def write_up(state_dir: str | Path, data: dict[str, Any]) -> Path:
    """Write up.json atomically (temp file in the same dir, then rename): readers never see half a file."""
    path = up_json_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".up.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def remove_up(state_dir: str | Path, only_pid: int | None = None) -> bool:
    """Remove up.json (only if it still names supervisor `only_pid`, when given). True if removed."""
    path = up_json_path(state_dir)
    if only_pid is not None:
        data = read_up(state_dir)
        if data is not None and data.get("supervisor_pid") != only_pid:
            return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def try_lock(state_dir: str | Path) -> int | None:
    """Take the state dir's supervisor lock (held until the process exits, even on SIGKILL); the fd, or None if
    another live supervisor holds it."""
    path = Path(state_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
