"""Where a bench's results go: `<out>/<name>-<stamp>.json` with the raw figures and `.md` with their tables, the
stamp the run's start (YYYYmmdd-HHMMSS) so that a run saved as it goes overwrites its own files, not another's."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # the committed results; benches write there by default


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def args_record(args: argparse.Namespace) -> dict:
    """A run's arguments as its JSON keeps them (paths as text)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_results(out: Path | None, name: str, data: dict, md: str | None, *, at: str | None = None) -> Path | None:
    """<out>/<name>-<at>.json (and .md unless `md` is None), `at` the time now unless given (a bench that saves as
    it goes passes the same stamp each time); nothing without `out`. Returns the JSON's path."""
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{at or stamp()}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    if md is not None:
        path.with_suffix(".md").write_text(md)
    return path


class RunFiles:
    """One run's `<stem>.json` and `<stem>.md`, written again after every part it measures (a run cut short by a
    time limit keeps what it measured); a bench's subclass renders `data` as markdown."""

    def __init__(self, out_dir: Path, stem: str, data: dict) -> None:
        self.data = data
        self.json_path, self.md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
        out_dir.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        self.json_path.write_text(json.dumps(self.data, indent=2) + "\n")
        self.md_path.write_text(self.markdown())

    def markdown(self) -> str:
        raise NotImplementedError
