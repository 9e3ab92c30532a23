"""bench/roofline_sparks.py: the two-Spark prediction runs from the engine's own counts, and the same model applied
to one H200 lands within 25% of the committed whole-model step (12.2 ms at batch 1, exl3:2.5+fp8)."""

from __future__ import annotations

from bench import roofline_sparks as rs
from model.checkpoint.spec import TinySpec

SPEC = TinySpec(num_hidden_layers=45, dense_layers=3, num_nextn_predict_layers=1)


def test_the_h200_prediction_is_within_a_quarter_of_the_committed_step() -> None:
    step = rs.decode_step_s(rs.HARDWARE["h200"], SPEC, rs.stored_bytes("exl3:2.5+fp8"), 1)["step_s"]
    assert 0.75 <= step / rs.COMMITTED_STEP_S <= 1.25


def test_two_sparks_pay_the_link_and_split_the_bytes() -> None:
    stored = rs.stored_bytes("exl3:4.0+w4a16")
    one = rs.decode_step_s(rs.HARDWARE["gb10x2"], SPEC, stored, 1)
    four = rs.decode_step_s(rs.HARDWARE["gb10x2"], SPEC, stored, 4)
    assert one["collectives_s"] > 0 and four["experts_s"] > one["experts_s"] and four["tok_s"] > one["tok_s"]
    assert rs.prefill_tok_s(rs.HARDWARE["gb10x2"], SPEC, 1_048_576) < rs.prefill_tok_s(rs.HARDWARE["gb10x2"], SPEC,
                                                                                        8192)
