"""The checkpoint `twinspark up` serves when no `--model` is given: a tiny GLM-5.3-Flash made on first use and
cached at `$TWINSPARK_CACHE_DIR/tiny-default` (default cache root: `$XDG_CACHE_HOME/twinspark`, else
`~/.cache/twinspark`).

Made atomically: written into a temp dir beside the target, marked complete, then renamed into place. Two `up`s
racing both build; one rename wins, the other discards its copy and uses the winner's. A failed build removes its temp dir; a killed one leaves only a
`.tiny-default.tmp-*` dir behind, never a half-written `tiny-default`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

# The number goes up whenever make-tiny writes something a newer twinspark needs (2: the image processor's settings
# and a vision tower of useful scale; 3: processor_config.json, which exllamav3 reads), so a checkpoint cached by an
# older version is never served by a newer one.
NAME = "tiny-default-3"
MARKER = ".twinspark-tiny-default.json"  # written last into the temp dir: its presence means "complete"
SEED = 0


def cache_root() -> Path:
    if os.environ.get("TWINSPARK_CACHE_DIR"):
        return Path(os.environ["TWINSPARK_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "twinspark"


def _default_maker(out_dir: Path) -> Path:
    from model.checkpoint import make_tiny  # imports torch: only when a checkpoint is really made

    return make_tiny(out_dir, seed=SEED)


def ensure_tiny_default(root: str | Path | None = None,
                        make: Callable[[Path], object] = _default_maker) -> tuple[Path, bool]:
    """The cached tiny checkpoint's path, making it first if needed. Returns (path, made_now)."""
    root = Path(root) if root is not None else cache_root()
    target = root / NAME
    if (target / MARKER).is_file():
        return target, False
    if target.exists():
        raise RuntimeError(f"{target} exists but is not a complete tiny checkpoint made by twinspark "
                           f"(no {MARKER}); remove it and run again")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{NAME}.tmp-"))
    try:
        make(tmp)
        (tmp / MARKER).write_text(json.dumps({"seed": SEED, "maker": "model.checkpoint.make_tiny"}) + "\n")
        try:
            os.rename(tmp, target)  # atomic; fails if another process renamed its copy in first
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not (target / MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return target, False
        return target, True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
