"""Measurements stay out of the product code: kernels/, model/, ops/ and services/ keep the decision a measurement
led to and a pointer into docs/ (docs/benchmarks.md has the figures, with the GPU, the day and the results file).
A figure in a comment belongs to one tile, one GPU and one run, and goes stale where nobody re-reads it.

Rules, each failure named file:line:
- no results file, anywhere in a file of those folders: neither "bench/results" nor a results file's name (a bench's
  name and the run's date: "whole_model-20261205-115332", "long_served-20261202-*");
- no measured timing in a comment or docstring: a number with a unit of time or rate (s, ms, µs, us, TB/s, GB/s,
  tok/s) in the same paragraph as a GPU's name (H100, H200, GB10, B200, A100, Spark) or the word "measured" or "took".
  A constant the code chooses ("back off to 1 ms") or a limit of the hardware ("99 KiB a block") names no
  measurement and passes; so does a message string the code prints (only comments and docstrings are read);
- a pointer written as docs/<page>.md, "Heading" names a heading of that page.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("kernels", "model", "ops", "services")
SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}  # and every folder whose name starts with "."

RESULTS = re.compile(r"bench/results|\b[a-z][a-z0-9_]*-20\d{6}\b")
FIGURE = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)?\s?(?:s|ms|µs|us|TB/s|GB/s|tok/s)(?![\w/])")
MEASURED = re.compile(r"\b(?:H100|H200|GB10|B200|A100|Sparks?|measured|took)\b", re.IGNORECASE)
POINTER = re.compile(r"docs/([\w.-]+\.md),? \"([^\"]+)\"")
COMMENT_MARK = re.compile(r"^\s*(?:#+|//+|/?\*+/?|\{#|#\})\s?")

Paragraph = list[tuple[int, str]]  # (line number, text without its comment marker)


def product_files() -> list[Path]:
    """Every text file under the four folders (hidden folders and build output pruned, binary files skipped)."""
    files = []
    for top in FOLDERS:
        for folder, dirs, names in os.walk(ROOT / top):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS]
            for name in names:
                path = Path(folder) / name
                if b"\0" not in path.read_bytes()[:8192]:
                    files.append(path)
    return sorted(files)


def _split(lines: list[tuple[int, str]]) -> list[Paragraph]:
    """Runs of lines cut at blank ones."""
    out: list[Paragraph] = [[]]
    for number, text in lines:
        if text.strip():
            out[-1].append((number, text.strip()))
        elif out[-1]:
            out.append([])
    return [p for p in out if p]


def python_paragraphs(source: str) -> list[Paragraph]:
    """The comments (consecutive comment lines make one block) and docstrings of a Python source, as paragraphs."""
    blocks: list[list[tuple[int, str]]] = []
    last = -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            number = tok.start[0]
            if number != last + 1:
                blocks.append([])
            blocks[-1].append((number, COMMENT_MARK.sub("", tok.string)))
            last = number
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            first, end = body[0].lineno, body[0].end_lineno or body[0].lineno
            blocks.append([(n, lines[n - 1]) for n in range(first, end + 1)])
    return [p for block in blocks for p in _split(block)]


def text_paragraphs(source: str) -> list[Paragraph]:
    """Any other text file (CUDA, templates): every line, comment markers stripped, cut at blank lines."""
    return _split([(n, COMMENT_MARK.sub("", line)) for n, line in enumerate(source.splitlines(), 1)])


def paragraphs(path: Path, source: str) -> list[Paragraph]:
    return python_paragraphs(source) if path.suffix == ".py" else text_paragraphs(source)


def measured_figures(paras: list[Paragraph]) -> list[tuple[int, str]]:
    """(line, figure) for every timing in a paragraph that also names a GPU or a measurement. A docs pointer's
    heading ("Integer experts on one H100") is a title, not a claim: it is left out of the search."""
    found = []
    for para in paras:
        joined = POINTER.sub("", " ".join(text for _, text in para))
        if MEASURED.search(joined):
            found += [(n, m.group(0)) for n, text in para for m in FIGURE.finditer(text)]
    return found


def results_mentions(source: str) -> list[tuple[int, str]]:
    return [(n, m.group(0)) for n, line in enumerate(source.splitlines(), 1) for m in RESULTS.finditer(line)]


def pointers(paras: list[Paragraph]) -> list[tuple[int, str, str]]:
    """(first line of the paragraph, page, heading) of every docs/<page>.md, "Heading" pointer."""
    return [(para[0][0], m.group(1), m.group(2)) for para in paras
            for m in POINTER.finditer(" ".join(text for _, text in para))]


def headings(page: Path) -> set[str]:
    """A page's heading titles, their section numbers left out ("## 5. Exactness rules" -> "Exactness rules")."""
    return {m.group(1) for line in page.read_text(encoding="utf-8").splitlines()
            if (m := re.match(r"#{1,6}\s+(?:\d+(?:\.\d+)*\.?\s+)?(.+?)\s*$", line))}


def test_the_rules_catch_what_they_should():
    bad = '''
# K steps: 4 (bench/results/kernels-20261204-075745: the router 8.1 -> 6.4 us on an H200)
X = 4
def f():
    """Took 0.35 ms as int64, decode_prefill-20261205-0224-bf16-mlatile."""
# 2,243 us per 32 KB all_gather
# measured on one H100.

# Warm-up: the first prompt took 105-121 s.
'''
    assert [n for n, _ in results_mentions(bad)] == [2, 2, 5]
    assert sorted(measured_figures(python_paragraphs(bad))) == [
        (2, "6.4 us"), (5, "0.35 ms"), (6, "2,243 us"), (9, "121 s")]
    cuda = "// Measured on an H200: 28.4 us with the rotations\n//\n// 24.2 us elsewhere, 1.35 TB/s\n"
    assert measured_figures(text_paragraphs(cuda)) == [(1, "28.4 us")]
    assert results_mentions("see long_served-20261202-*.md") and results_mentions("whole_model-20261205-115332")
    good = '''
# Yield at first, then back off to 1 ms: ranks share the cores.
BACKOFF_S = 1e-3
# Programs per GEMM: about two waves on an H200's 132 SMs. GB10 has 99 KiB a block, so 3 stages.
PROGRAMS = 256
DEADLINE_S = 0.4  # a 0.4 s deadline
HELP = "fit in 8 ms of measured decode time"

# as many steps as fit in 8 ms of decode time (docs/benchmarks.md, "Integer experts on one H100")
STEP_MS = 8.0
'''
    assert measured_figures(python_paragraphs(good)) == [] and results_mentions(good) == []
    assert pointers(python_paragraphs(good)) == [(9, "benchmarks.md", "Integer experts on one H100")]


def test_no_results_files_or_measured_timings_in_product_code():
    files = product_files()
    assert any(p.name == "gemm.py" for p in files), "the scan found none of the product code"
    problems = []
    for path in files:
        source = path.read_text(encoding="utf-8", errors="replace")
        where = path.relative_to(ROOT)
        problems += [f"{where}:{n}: {hit!r} names a results file: point into docs/benchmarks.md instead"
                     for n, hit in results_mentions(source)]
        problems += [f"{where}:{n}: {hit!r} is a measured timing: keep the decision, move the figure to docs/"
                     for n, hit in measured_figures(paragraphs(path, source))]
    assert not problems, "figures in product code:\n" + "\n".join(problems)


def test_docs_pointers_name_a_heading():
    problems = []
    for path in product_files():
        source = path.read_text(encoding="utf-8", errors="replace")
        for n, page, heading in pointers(paragraphs(path, source)):
            doc = ROOT / "docs" / page
            if not doc.is_file() or heading not in headings(doc):
                problems.append(f'{path.relative_to(ROOT)}:{n}: docs/{page} has no heading "{heading}"')
    assert not problems, "pointers that do not resolve:\n" + "\n".join(problems)
