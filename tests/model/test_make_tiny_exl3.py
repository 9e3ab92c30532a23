"""`make-tiny --format exl3` writes what exllamav3 1.6.5's loader reads, checked against its source:

- `modules/linear.py` `Linear.load_exl3` / `is_exl3_storage`: a linear is EXL3 when `X.trellis` and `X.suh` / `X.svh`
  exist; `X.mcg` / `X.mul1` (read by `get_codebook_marker`: an int32 scalar holding the codebook's multiplier)
  pick the codebook; otherwise `X.weight` is loaded as fp16 (`load_fp16`), so dense attention may sit beside EXL3
  MLPs.
- `modules/quant/exl3.py` `LinearEXL3.__init__`: trellis int16 with 3 dims, suh / svh float16; K = trellis.shape[-1]
  / 16; tensor-parallel splits slice trellis dim 1 (out) / dim 0 (in) by 16 (in / 16, out / 16 tiles).
- `conversion/compile.py`: `quantization_config = {"quant_method": "exl3", "bits", "head_bits", "codebook", ...}`;
  `conversion/quant_config.py`: quantization_config.json = that + `tensor_storage` (each module's stored tensors and
  `bits_per_weight`), which exllamav3's loader does not read (it takes K from the trellis' last dim).
"""

from __future__ import annotations

import json

import pytest
import torch

from model.checkpoint import make_tiny, write_tiny
from tests.model.quant_helpers import read_tensors

TEXT = "model.language_model."
MARKER_VALUE = {"mul1": 0x83DCD12D, "mcg": 0xCBAC1FED}


def test_mlp_linears_are_exllamav3_tensors_and_attention_stays_dense(tiny_exl3):
    t = read_tensors(tiny_exl3)
    cfg = json.loads((tiny_exl3 / "config.json").read_text())
    text = cfg["text_config"]
    H, inter, moe = text["hidden_size"], text["intermediate_size"], text["moe_intermediate_size"]
    linears = {f"{TEXT}layers.0.mlp.{p}": s for p, s in (("gate_proj", (inter, H)), ("down_proj", (H, inter)))}
    linears.update({f"{TEXT}layers.1.mlp.experts.{e}.{p}": s for e in (0, 3)
                    for p, s in (("up_proj", (moe, H)), ("down_proj", (H, moe)))})
    linears[f"{TEXT}layers.1.mlp.shared_experts.gate_proj"] = (moe, H)
    for key, (out, inp) in linears.items():
        assert f"{key}.weight" not in t, key
        trellis, suh, svh, mul1 = (t[f"{key}.{n}"] for n in ("trellis", "suh", "svh", "mul1"))
        assert trellis.dtype == torch.int16 and tuple(trellis.shape) == (inp // 16, out // 16, 16 * 4), key
        assert suh.dtype == svh.dtype == torch.float16 and tuple(suh.shape) == (inp,) and tuple(svh.shape) == (out,)
        assert mul1.dtype == torch.int32 and mul1.dim() == 0 and int(mul1) & 0xFFFFFFFF == MARKER_VALUE["mul1"]
        assert f"{key}.mcg" not in t
    # attention, router, embeddings and lm_head stay in the checkpoint dtype
    for key in (f"{TEXT}layers.0.self_attn.q_proj", f"{TEXT}layers.3.self_attn.q_a_proj", f"{TEXT}layers.1.mlp.gate",
                f"{TEXT}embed_tokens", "lm_head"):
        assert t[f"{key}.weight"].dtype == torch.bfloat16 and f"{key}.trellis" not in t
    assert cfg["quantization_config"] == {"quant_method": "exl3", "bits": 4, "head_bits": 16, "codebook": "mul1",
                                          "calibration": None}


@pytest.mark.parametrize("bits, codebook", [(2, "mcg"), (2.5, "mul1"), (3, "3inst")])
def test_bits_and_codebooks(bits, codebook, tmp_path):
    out = make_tiny(tmp_path / "t", layers=1, experts=2, format="exl3", exl3_bits=bits, exl3_codebook=codebook)
    t = read_tensors(out)
    key = f"{TEXT}layers.0.mlp.up_proj"
    assert t[f"{key}.trellis"].shape[-1] == 16 * bits
    markers = {n for n in ("mcg", "mul1") if f"{key}.{n}" in t}
    assert markers == ({codebook} if codebook in MARKER_VALUE else set())


def test_same_seed_same_bytes(tiny_exl3, tmp_path):
    again = make_tiny(tmp_path / "again", format="exl3", layers=4, experts=4)
    for f in sorted(tiny_exl3.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_fractional_rate_is_a_mix_recorded_per_linear(tmp_path):
    """--format exl3:2.5 with mcg (no half rate): 2 and 3 bits by quantize/bits.py's rule; each linear's rate in
    quantization_config.json as exllamav3's converter records it (conversion/quant_config.py: tensor_storage)."""
    out = make_tiny(tmp_path / "t", layers=2, experts=2, format="exl3", exl3_bits=2.5, exl3_codebook="mcg")
    t = read_tensors(out)
    storage = json.loads((out / "quantization_config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in storage.items() if k != "tensor_storage"} == cfg and 2 < cfg["bits"] <= 2.5
    rates = {}
    for module, entry in storage["tensor_storage"].items():
        trellis = t[f"{module}.trellis"]
        assert entry["quant_format"] == "exl3" and entry["mcg_multiplier"] == MARKER_VALUE["mcg"]
        assert entry["bits_per_weight"] == trellis.shape[-1] / 16
        assert entry["stored_tensors"][f"{module}.trellis"] == {"shape": list(trellis.shape),
                                                              "n_bytes": trellis.numel() * 2, "dtype": "torch.int16"}
        rates[module] = entry["bits_per_weight"]
    assert set(rates.values()) == {2, 3}
    assert set(rates) == {k.removesuffix(".trellis") for k in t if k.endswith(".trellis")}


def test_bad_rate_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="from 1 to 8"):
        write_tiny(tmp_path / "x", format="exl3", exl3_bits=9, progress=False)
    assert not (tmp_path / "x").exists()
