"""bench.exactness's distinct-token counts and per-request lines: pure functions of token id lists (no stack)."""

from bench.concurrency_check import Check, requests
from bench.exactness import distinct_tokens, request_lines, varied_line, varied_replies


def test_distinct_tokens_counts_the_first_32_only() -> None:
    assert distinct_tokens([7] * 38) == 1  # one token repeated: what a collapsed random model answers
    assert distinct_tokens(list(range(40))) == 32
    assert distinct_tokens([1, 2, 2, 3]) == 3  # a short reply: all of it
    assert distinct_tokens([]) == 0


def test_varied_replies_and_the_summary_line() -> None:
    replies = [list(range(32)), [5] * 32, [1, 2] * 16, list(range(8)) * 4, list(range(7)) + [0] * 30]
    assert varied_replies(replies) == 2  # 32 and exactly 8 distinct; 1, 2 and 7 fall short
    assert varied_line(replies) == "replies with >= 8 distinct tokens in their first 32: 2/5"


def test_request_lines_give_each_verdict_beside_the_distinct_count() -> None:
    bodies = requests(n=2)
    ref = [[3] * 10, list(range(12))]
    lines = request_lines(bodies, ref, [[3] * 10, list(range(12))], [[3] * 10, [0] * 12], ("TP 2", [[3] * 10, ref[1]]))
    assert len(lines) == 2
    assert lines[0].startswith(f"request  0 (greedy, {len(bodies[0]['prompt'])}-id prompt, 10 tokens): ")
    assert lines[0].endswith("staggered same, burst same, TP 2 same; 1 distinct in its first 32")
    assert lines[1].startswith("request  1 (T=0.8, ")
    assert lines[1].endswith("staggered same, burst DIFFERENT, TP 2 same; 12 distinct in its first 32")
    assert "TP 2" not in request_lines(bodies, ref, ref, ref, ("TP 2", ref[:1]))[0]  # another mix: no verdict


def test_main_keeps_the_counts_and_the_comparison_last(tmp_path, monkeypatch, capsys) -> None:
    """bench/gpu_check.sh's tp2one tails the log: its last line is the counts, or the counts and the --same-as
    comparison; the --json has each reply's distinct count beside its ids."""
    import json
    from types import SimpleNamespace

    from bench import exactness

    replies = [list(range(i, i + 20)) for i in range(11)] + [[4] * 20]
    monkeypatch.setattr(exactness, "attach_or_start", lambda *a, **kw: SimpleNamespace(url="x", down=lambda: None))
    monkeypatch.setattr(exactness, "check", lambda url, bodies: Check(replies, replies, replies))
    assert exactness.main(["--label", "TP 2", "--json", str(tmp_path / "tp2.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "replies with >= 8 distinct tokens in their first 32: 11/12",
        "TP 2: staggered 12/12 identical to serial, burst 12/12"]
    saved = json.loads((tmp_path / "tp2.json").read_text())
    assert saved["distinct_in_first_32"] == [20] * 11 + [1] and saved["replies_with_8_distinct"] == 11
    assert exactness.main(["--label", "TP 1", "--same-as", str(tmp_path / "tp2.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "TP 1: staggered 12/12 identical to serial, burst 12/12",
        "TP 1 serial = TP 2 serial: 12/12 requests, the same token ids"]
