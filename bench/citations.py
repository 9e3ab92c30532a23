"""Which documents cite which results files: the README, docs/ and bench/'s own pages against bench/results/.

A document cites a file when it names it, names its run (the name without its extension: `whole_model-20261205-115332`
cites that run's .json and .md, not its -rank0.log), or gives a pattern that matches it (`trace-20261202-*.md`,
`virtual{1,4}.txt`). A path into bench/results/ says the file is in the tree; a bare run name may be one that git
history keeps.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterator

from bench.output import RESULTS

ROOT = RESULTS.parents[1]
INDEX = RESULTS / "README.md"
# A pattern in a document: a run's date with a wildcard or {a,b} choices around it (markdown's **bold** is no pattern).
PATTERN = re.compile(r"[\w.*{},/-]*[*{][\w.*{},/-]*")
RUN_DATE = re.compile(r"-20\d{6}")


def results_files() -> list[str]:
    """Every file under bench/results/ but the index, as a path relative to it."""
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p != INDEX)


def documents() -> dict[str, str]:
    """The documents that cite results: the README, docs/ and bench/'s own pages, by path from the repository root."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in pages if p.is_file()}


def _expand(pattern: str) -> Iterator[str]:
    """A pattern's {a,b} choices spelled out (`virtual{1,4}.txt` -> `virtual1.txt`, `virtual4.txt`)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        yield pattern
        return
    for choice in m.group(1).split(","):
        yield from _expand(pattern[: m.start()] + choice + pattern[m.end():])


@functools.cache
def _patterns(text: str) -> tuple[str, ...]:
    """A document's patterns of results files, their {a,b} choices spelled out."""
    tokens = (t.strip(".,;:)").removeprefix("bench/results/") for t in PATTERN.findall(text) if RUN_DATE.search(t))
    return tuple(p for t in tokens for p in _expand(t))


def cites(text: str, name: str) -> bool:
    """Whether a document's text cites the results file `name` (the module's text says how)."""
    plain = re.escape(name)
    if re.search(rf"(?<![\w-]){plain}(?![\w-])", text):
        return True
    run = re.escape(name.split("/")[-1].split(".")[0])
    if re.search(rf"(?<![\w-]){run}(?![\w-])(?!\.\w)", text):  # the run, no extension after it
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in _patterns(text))


def citations(files: list[str], docs: dict[str, str]) -> dict[str, list[str]]:
    """file -> the documents that cite it."""
    return {f: [d for d, text in docs.items() if cites(text, f)] for f in files}


def missing_paths(docs: dict[str, str], files: list[str]) -> list[str]:
    """`bench/results/...` paths the documents give that match no file here."""
    present = [*files, INDEX.name]
    stems = {f.split(".")[0] for f in present}
    out = []
    for doc, text in docs.items():
        for m in re.finditer(r"bench/results/([\w.*{},/-]+)", text):
            path = m.group(1).rstrip(".,;:/")
            found = path in stems or any(f.startswith(path + "/") for f in present) or \
                any(fnmatch.fnmatchcase(f, p) for p in _expand(path) for f in present)
            if path and not found:
                out.append(f"{doc}: bench/results/{path}")
    return out
