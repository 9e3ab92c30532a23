"""Every "§N" citation resolves to a numbered heading of the docs file it names, and the README stays a front page.

Code (every .py and .proto file of the repository, generated stubs and virtual environments aside) cites the design
as "docs/design.md §5.1" and the reference facts as "docs/reference.md §6": a "§" must follow, on the same line, the
docs file it points into, and that file must have a heading numbered so ("## 5. Exactness rules", "### 5.1 The same
rules on a GPU"). The README and the pages of docs/ are held to the same rule; inside a docs page a section sign
with no file named before it points at the page itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 250

SKIP_DIRS = {"node_modules", "build", "dist", "__pycache__"}  # and every folder whose name starts with "."
CODE_SUFFIXES = {".py", ".proto"}
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s")
CITATION = re.compile(r"§\s?(\d+(?:\.\d+)*)")
DOC_NAME = re.compile(r"(?:docs/)?([\w.-]+\.md)\b")


def code_files() -> list[Path]:
    """Every .py / .proto file of the repository; hidden folders, virtual environments and build output pruned."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                   and not (Path(folder) / d / "pyvenv.cfg").exists()]
        files += [Path(folder) / n for n in names if Path(n).suffix in CODE_SUFFIXES and "_pb2" not in n]
    return sorted(files)


def headings(doc: Path) -> set[str]:
    """The section numbers of a docs page's headings ("5", "5.1", ...), fenced code blocks left out."""
    numbers, fenced = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            numbers.add(m.group(1))
    return numbers


def citations(path: Path, *, own_page: str | None = None, code_only: bool = True) -> list[tuple[int, str, str]]:
    """(line number, docs page, section) for every § in `path`. The page is the last docs file named before the § on
    its line ("" when none is named: an error, except inside a docs page, where it means `own_page`)."""
    found = []
    text = path.read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        for m in CITATION.finditer(line):
            pages = DOC_NAME.findall(line[: m.start()])
            if code_only:  # code must name the file with its folder: "docs/design.md §5.1"
                pages = re.findall(r"docs/([\w.-]+\.md)\b", line[: m.start()])
            found.append((number, pages[-1] if pages else (own_page or ""), m.group(1)))
    return found


def unresolved(items: list[tuple[Path, int, str, str]]) -> list[str]:
    known: dict[str, set[str] | None] = {}
    problems = []
    for path, number, page, section in items:
        where = f"{path.relative_to(ROOT)}:{number}"
        if not page:
            problems.append(f"{where}: §{section} names no docs file (write it as docs/<page>.md §{section})")
            continue
        if page not in known:
            known[page] = headings(DOCS / page) if (DOCS / page).is_file() else None
        if known[page] is None:
            problems.append(f"{where}: §{section} points into docs/{page}, which does not exist")
        elif section not in known[page]:
            problems.append(f"{where}: docs/{page} has no heading numbered {section}")
    return problems


def test_code_citations_resolve_to_docs_headings():
    files = code_files()
    assert any(p.name == "cache.py" for p in files), "the scan found none of the repository's code"
    items = [(p, n, page, s) for p in files for n, page, s in citations(p)]
    assert items, "no § citation found in the code: the scan is broken"
    problems = unresolved(items)
    assert not problems, "citations that do not resolve:\n" + "\n".join(problems)


def test_readme_and_docs_citations_resolve():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    items = []
    for p in pages:
        own = p.name if p.parent == DOCS else None
        items += [(p, n, page, s) for n, page, s in citations(p, own_page=own, code_only=False)]
    problems = unresolved(items)
    assert not problems, "citations that do not resolve:\n" + "\n".join(problems)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the long material into docs/")
