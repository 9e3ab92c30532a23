"""Print the README's shell block tagged `<!-- ci: NAME -->` (the fenced block right after the tag), so CI runs the
commands a newcomer reads, not a copy of them that could drift.

usage: python3 .ci/readme_block.py NAME [README]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def block(text: str, name: str) -> str:
    match = re.search(rf"<!-- ci: {re.escape(name)} -->\s*\n```[a-z]*\n(.*?)\n```", text, re.S)
    if match is None:
        raise SystemExit(f"README has no block tagged <!-- ci: {name} --> followed by a fenced code block")
    return match.group(1)


if __name__ == "__main__":
    readme = Path(sys.argv[2] if len(sys.argv) > 2 else Path(__file__).resolve().parent.parent / "README.md")
    print(block(readme.read_text(), sys.argv[1]))
