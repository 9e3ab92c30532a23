"""bench/results/ stays a kept room: at most LIMIT files, each cited by a document (bench/citations.py), every
`bench/results/...` path a document gives is there, and the index (bench/results/README.md) is what
`python -m bench.results_index` writes."""

from __future__ import annotations

from bench import results_index as ri
from bench.citations import INDEX, cites, citations, documents, missing_paths, results_files


def test_at_most_the_limit_of_files() -> None:
    count = len(results_files()) + 1  # the index
    assert count <= ri.LIMIT, f"bench/results/ holds {count} files (at most {ri.LIMIT}): remove superseded runs"


def test_every_file_is_cited_by_a_document() -> None:
    cited = citations(results_files(), documents())
    uncited = [name for name, docs in cited.items() if not docs]
    assert not uncited, f"cited by no document (README.md, docs/*.md, bench/*.md): {uncited}"


def test_document_paths_into_results_exist() -> None:
    missing = missing_paths(documents(), results_files())
    assert not missing, f"paths to files not in bench/results/ (name a superseded run without the path): {missing}"


def test_index_is_current() -> None:
    assert INDEX.read_text() == ri.render(), "bench/results/README.md is stale: python -m bench.results_index"


def test_a_name_its_run_or_a_pattern_cites_a_file() -> None:
    text = "see `whole_model-20261205-115332` and `trace-20261202-*.md`, `grammar_mask.md`, **0** lost"
    assert cites(text, "whole_model-20261205-115332.json") and cites(text, "whole_model-20261205-115332.md")
    assert not cites(text, "whole_model-20261205-115332-rank0.log")  # another file of the run, not named
    assert cites(text, "trace-20261202-123445.md") and cites(text, "grammar_mask.md")
    assert not cites(text, "fuzz-20261201-005249.md")  # markdown's bold is no pattern
    assert not cites("`kernels-20261130-235732.log`", "kernels-20261130-235732.json")  # the .log, not the run
    assert cites("`prof-20261201/rank0-rounds-virtual{1,4}.txt`", "prof-20261201/rank0-rounds-virtual4.txt")
