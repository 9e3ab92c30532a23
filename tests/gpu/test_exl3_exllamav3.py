"""Interop with exllamav3 1.6.5 itself: EXL3 tensors written by twinspark (`make-tiny --format exl3`, and random
linears at real dims) load in exllamav3 and compute what our kernels and our twin compute.

Per linear: every EXL3 linear of make-tiny's default EXL3 checkpoint (and random ones at real dims) goes through
exllamav3's own loader and `LinearEXL3`. The whole model runs in exllamav3 in test_exl3_exllamav3_model.py, on a
checkpoint at the dims its fused attention / KDA kernels take (`make-tiny --preset exllamav3`; the default tiny
model's heads are below them). For each linear:
- exllamav3's `SafetensorsCollection` reads our files (header, dtypes, and its codebook-marker check of the value);
- its trellis reconstruction (`get_inner_weight_tensor`, the rotated weight T) equals our decode bit for bit;
- its dense weight (`get_weight_tensor`, which rounds to float16 between its Hadamard steps) matches our twin's
  within float16 rounding;
- its `LinearEXL3.forward` on 1..8 rows (its GEMV path) and 16 rows matches our GEMM and our twin within float16
  rounding (exllamav3 computes in float16 throughout; figures printed with `-s`).
exllamav3 is imported inside the tests (it loads its CUDA extension on import); without it they skip with the reason.
Install on the GPU host: `source <kit>/install.sh exllamav3` (../shared/device/README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
ROWS = (1, 2, 8, 16)
# Bounds: a wrong decode, codebook, Hadamard order or sign vector gives relative errors of order 1; float16 rounding
# gives ~5e-4 (ours against the twin: ~2.5e-4 measured on the CPU). exllamav3 rounds to float16 between its steps
# (its Hadamards, its operands), so comparisons with it get a wider bound than ours against the twin.
W_NORM_TOL = 5e-3  # ||W_exllamav3 - W_twin|| / ||W_twin||
TOL = {"exllamav3~twin": (1e-2, 2e-2), "ours~exllamav3": (1e-2, 2e-2), "ours~twin": (1e-3, 4e-3)}  # normwise, max


def _exllamav3():
    try:
        from exllamav3.loader.safetensors import SafetensorsCollection
        from exllamav3.modules.quant.exl3 import LinearEXL3
        from exllamav3.modules.quant.exl3_lib.quantize import codebook_mcg_mult, codebook_mul1_mult
    except Exception as e:  # ImportError, or its extension failing to load / build
        pytest.skip(f"exllamav3 is not usable here: {type(e).__name__}: {e}")
    return SafetensorsCollection, LinearEXL3, {"mcg": codebook_mcg_mult, "mul1": codebook_mul1_mult}


@pytest.fixture(scope="module")
def tiny_exl3(tmp_path_factory) -> Path:
    from model.checkpoint import make_tiny
    return make_tiny(tmp_path_factory.mktemp("exl3_interop") / "ckpt", seed=3, layers=2, experts=4, format="exl3",
                     exl3_bits=4, exl3_codebook="mul1")


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    d = got.double() - want.double()
    return (d.norm() / want.double().norm()).item(), (d.abs().max() / want.double().abs().max()).item()


def _check_linear(name: str, tensors: dict[str, torch.Tensor], marker: torch.Tensor | None, codebook: str,
                  LinearEXL3) -> None:
    """One EXL3 linear: exllamav3's LinearEXL3 over these tensors vs our decode, twin and GEMM."""
    from kernels.gpu import gemm, wtiles
    from kernels.quant import QuantizedWeight, exl3
    trellis, suh, svh = tensors["trellis"], tensors["suh"], tensors["svh"]
    inp, out = trellis.shape[0] * 16, trellis.shape[1] * 16
    kw = {codebook: marker} if codebook in ("mcg", "mul1") else {}
    lin = LinearEXL3(None, inp, out, suh=suh, svh=svh, trellis=trellis, out_dtype=torch.half, key=name, **kw)

    inner = lin.get_inner_weight_tensor()  # [in, out] float16, the rotated basis
    ours_t = exl3.decode_tiles(trellis, codebook).half()
    mismatched = (inner.view(torch.int16) != ours_t.view(torch.int16)).sum().item()
    q = QuantizedWeight.from_tensors("exl3", dict(tensors, **({codebook: marker.to(DEV)} if kw else {})))
    twin = q.dequantize()  # [out, in] float32
    w_norm, w_max = _errors(lin.get_weight_tensor().float().T, twin)
    print(f"\n{name} [{out}x{inp}] {q.params['bits']} bits {codebook}: T reconstruct vs our decode: {mismatched} of "
          f"{inner.numel()} differ; W vs twin normwise {w_norm:.2e}, max {w_max:.2e}")
    assert mismatched == 0
    assert w_norm <= W_NORM_TOL

    w = wtiles.quantized("exl3", q.tensors, dict(q.params))
    g = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(max(ROWS), inp, generator=g, device=DEV).half()
    for m in ROWS:
        xm = x[:m].contiguous()
        theirs = lin.forward(xm, {}, out_dtype=torch.float)
        ours = gemm.matmul(xm, w, m, torch.float32)  # decode-class rows
        ref = xm.float() @ twin.T
        pairs = {"exllamav3~twin": (theirs, ref), "ours~twin": (ours, ref), "ours~exllamav3": (ours, theirs)}
        figures = {pair: _errors(a, b) for pair, (a, b) in pairs.items()}
        print(f"  {m} rows: " + ", ".join(f"{k} {n:.2e}/{mx:.2e}" for k, (n, mx) in figures.items())
              + "  (normwise / max)")
        for pair, (n, mx) in figures.items():
            assert n <= TOL[pair][0] and mx <= TOL[pair][1], pair


def test_tiny_checkpoint_linears_load_in_exllamav3(tiny_exl3: Path) -> None:
    SafetensorsCollection, LinearEXL3, mults = _exllamav3()
    from kernels.quant import exl3
    stc = SafetensorsCollection(str(tiny_exl3), load_method="python")
    modules = sorted(k.removesuffix(".trellis") for k in stc.tensor_file_map if k.endswith(".trellis"))
    assert modules, "no EXL3 linear in the checkpoint"
    # every kind of EXL3 linear the checkpoint holds: the dense MLP, a routed and the shared expert, the MTP's eh_proj
    picked = {}
    for m in modules:
        kind = ("experts.0." if ".experts.0." in m else "shared" if "shared_experts" in m else
                "eh_proj" if "eh_proj" in m else "mlp" if ".experts." not in m else None)
        if kind is not None:
            picked.setdefault((kind, m.rsplit(".", 1)[-1]), m)
    print(f"\n{len(modules)} EXL3 linears in {tiny_exl3.name}; checking {len(picked)}")
    try:
        for m in picked.values():
            tensors = {n: stc.get_tensor(f"{m}.{n}", DEV, no_defer=True, arena=False)
                       for n in ("trellis", "suh", "svh")}
            assert tensors["trellis"].dtype == torch.int16 and tensors["suh"].dtype == torch.float16
            codebook = next((c for c in ("mcg", "mul1") if stc.has_tensor(f"{m}.{c}")), "3inst")
            marker = stc.get_codebook_marker(f"{m}.{codebook}", mults[codebook]) if codebook in mults else None
            assert codebook == "mul1" and marker is not None and int(marker) == exl3.marker("mul1")["mul1"].item()
            _check_linear(m, tensors, marker, codebook, LinearEXL3)
    finally:
        stc.close()


@pytest.mark.parametrize("bits,codebook", [(4, "mul1"), (3, "mcg"), (2, "3inst")])
def test_real_dim_linear_agrees_with_exllamav3(bits: float, codebook: str) -> None:
    _, LinearEXL3, _ = _exllamav3()
    from kernels.quant import exl3
    t = exl3.random_linear(12288, 4096, std=0.02, bits=bits, codebook_name=codebook,
                           generator=torch.Generator(device=DEV).manual_seed(5), device=DEV)
    marker = t.pop(codebook, None)
    _check_linear("random 4096->12288", t, None if marker is None else marker.cpu(), codebook, LinearEXL3)
