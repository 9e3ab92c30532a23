"""Unit tests: incremental detokenization, stop strings, and the output assembler that combines them."""

from __future__ import annotations

import hashlib
import struct

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.output import OutputAssembler, token_sha
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer import TextTokenizer

EOS = 1000


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids] + [detok.flush()]


def test_detokenizer_never_splits_a_character(tokenizer: TextTokenizer) -> None:
    text = "héllo 世界 🎉 ok"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters really are split across tokens here
    pieces = _stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "世" in pieces and "界" in pieces  # each CJK character comes out whole, in one piece


def test_detokenizer_holds_partial_bytes_until_complete(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("世")
    assert len(ids) == 3  # one byte per token
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(t) for t in ids] == ["", "", "世"]


def test_detokenizer_flushes_invalid_tail_and_skips_specials(tokenizer: TextTokenizer) -> None:
    partial = tokenizer.encode("世")[:2]
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(t) for t in [1002, 71, *partial]] == ["", "h", "", ""]  # [gMASK] skipped
    assert detok.flush() == "\ufffd"  # a reply cut mid-character still ends with what it had
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(_stream(keep, [1002, 71])) == "[gMASK]h"


def test_stop_string_across_chunks() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abcST") == "abc"  # "ST" might start STOP: held
    assert m.feed("O") == ""
    assert m.feed("P and more") == "" and m.hit is not None and m.hit.stop == "STOP"
    assert m.feed("later") == "" and m.flush() == ""


def test_stop_string_false_start_is_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("xS") == "x"
    assert m.feed("Tx") == "STx"
    assert m.feed("ST") == ""
    assert m.flush() == "ST" and m.hit is None  # the output ended: the held text was never a stop string


def test_stop_string_earliest_wins_and_include() -> None:
    m = StopStringMatcher(["world", "lo w"], include_stop_str=True)
    assert m.feed("hello world") == "hello w"
    assert m.hit is not None and m.hit.stop == "lo w"
    assert StopStringMatcher(["", "\n\n"]).feed("a\n\nb") == "a"  # empty stops ignored


def test_token_sha_is_int32_le() -> None:
    assert token_sha([1, 2, 300]) == hashlib.sha256(struct.pack("<3i", 1, 2, 300)).hexdigest()
    assert token_sha([]) == hashlib.sha256(b"").hexdigest()


def _assembler(tokenizer: TextTokenizer, **kw) -> OutputAssembler:
    kw.setdefault("stops", [])
    kw.setdefault("final_ids", frozenset({EOS}))
    return OutputAssembler(tokenizer, **kw)


def test_assembler_hides_stopping_token(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("hi 世")
    a = _assembler(tokenizer)
    d1 = a.add(ids[:3])
    d2 = a.add(ids[3:] + [EOS])
    d3 = a.finish(EOS)
    assert d1.text + d2.text + d3.text == "hi 世"
    assert a.token_ids == ids and a.stop_reason == EOS and a.generated == len(ids) + 1


def test_assembler_releases_held_id_when_output_continues(tokenizer: TextTokenizer) -> None:
    # A non-special stop token id (here "</think>") is held while it might be the last token ...
    think_end = tokenizer.token_to_id("</think>")
    a = _assembler(tokenizer, final_ids=frozenset({think_end}), skip_special_tokens=True)
    assert a.add([71, think_end]).text == "h"
    assert a.add([75]).text == "</think>l"  # ... and released when more output follows
    assert a.finish(None).text == "" and a.token_ids == [71, think_end, 75] and a.stop_reason is None


def test_assembler_stop_string_truncates_ids(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("say STOP now")
    a = _assembler(tokenizer, stops=["STOP"])
    text = a.add(ids[:2]).text + a.add(ids[2:]).text
    assert text == "say " and a.stopped_by_string and a.stop_reason == "STOP"
    # ids up to the one that completed the stop string; none after it
    assert tokenizer.decode(a.token_ids).startswith("say STOP") and "now" not in tokenizer.decode(a.token_ids)
    assert a.finish(None).text == ""


def test_stop_strings_wait_for_min_tokens(tokenizer: TextTokenizer) -> None:
    """vLLM's min_tokens: a stop string in the text of the first min_tokens tokens does not stop the reply."""
    ids = tokenizer.encode("a STOP b STOP c")
    k = next(i for i in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:i]))  # tokens to the 1st STOP
    a = _assembler(tokenizer, stops=["STOP"], min_tokens=k)
    text = a.add(ids).text + a.finish(None).text
    assert text.startswith("a STOP b") and text.count("STOP") == 1 and a.stop_reason == "STOP"
    plain = _assembler(tokenizer, stops=["STOP"])
    assert plain.add(ids).text + plain.finish(None).text == "a "
