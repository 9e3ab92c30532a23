"""EXL3, exllamav3's trellis format: torch decode (the CPU compute path and the GPU EXL3 GEMM's parity oracle) and
random trellis weights. Written from exllamav3 1.6.5's source (`modules/quant/exl3.py`, `exl3_lib/quantize.py`,
`exllamav3_ext/quant/{codebook.cuh, exl3_dq.cuh, pack.cu, reconstruct.cu}`); nothing here imports it (it needs CUDA).

Storage of a linear `X` (exllamav3's names and dtypes; the weight is kept as [in, out], exllamav3's orientation):
- `X.trellis` int16 [in / 16, out / 16, 16 * K]: one 16x16 tile of the rotated weight per (in, out) tile, 256
  trellis steps of K bits each (K = bits per weight: 1..8, or 1.5 / 2.5 / 3.5 with the mul1 codebook, whose steps
  alternate floor(K) and floor(K) + 1 bits, the odd steps carrying the extra bit).
- `X.suh` float16 [in], `X.svh` float16 [out]: input / output sign-and-scale vectors.
- `X.mcg` or `X.mul1`: int32 scalar markers naming the codebook (their value is the hash multiplier); neither = 3INST.
The dense HF weight [out, in] is W = diag(svh) . H . T^T . H . diag(suh), with T [in, out] the decoded tiles and H
the 128x128 Sylvester Hadamard matrix scaled by 1/sqrt(128), applied per 128 block on both sides. So in and out must
be multiples of 128 (exllamav3 pads its linears to 128), and a tensor-parallel cut must fall on a 128 boundary even
though tiles are 16 wide: every output of a Hadamard block depends on the whole block.

Decoding one tile: its 16 * K int16 words form a bit stream, most significant bit first, in which each pair of
words is stored swapped (exllamav3 reads it as big-endian 32-bit words). Step j's 16-bit state is the window of the
stream ending at the end of step j's bits, wrapping around the tile's end. The state is hashed to a float16 by the
codebook; step j lands at `TILE_ORDER[j]` of the row-major 16x16 tile (rows = input, columns = output), the
tensor-core fragment order exllamav3's encoder permutes tiles into.

Our arithmetic (float32): both Hadamard transforms run as butterflies (additions and subtractions only) and the
1/128 and sign/scale vectors are applied in one product at the end, so every element is computed the same way
whatever part of the tensor is decoded (dequantize(cut) == cut(dequantize) bit for bit). exllamav3 itself rounds to
float16 between its steps: expect differences of float16 size against its `get_weight_tensor`, not bit equality.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch

from kernels.quant.codec import Codec, Index, Params, axis_index

QUANT_METHOD = "exl3"
CODEBOOKS = ("mul1", "mcg", "3inst")  # exllamav3 1.6.5's converter defaults to mul1
MARKERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}  # the value each marker tensor holds (as uint32)
HAD = 128  # Hadamard block
TILE = 16
STEPS = TILE * TILE
HALF_BITS = (1.5, 2.5, 3.5)  # half-integer rates exist for mul1 only


def _tile_order() -> torch.Tensor:
    """Row-major tile position of each trellis step: lane t of a warp holds steps 8t..8t+7 at rows r0, r0 + 1,
    r0 + 8, r0 + 9 of columns t // 4 and t // 4 + 8, with r0 = 2 * (t % 4) (exllamav3's `tensor_core_perm`)."""
    order = []
    for t in range(32):
        r0, c0 = (t % 4) * 2, t // 4
        for c in (c0, c0 + 8):
            order += [r * TILE + c for r in (r0, r0 + 1, r0 + 8, r0 + 9)]
    return torch.tensor(order, dtype=torch.int64)


TILE_ORDER = _tile_order()


def _fp16_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint16 bit patterns held in an int64 tensor -> the float16 values they encode."""
    return bits.to(torch.int32).to(torch.int16).view(torch.float16)  # int32 -> int16 keeps the low 16 bits


@lru_cache(maxsize=None)
def codebook(name: str) -> torch.Tensor:
    """The float16 value of each of the 65536 trellis states (exllamav3's procedural codebooks, `decode_3inst`)."""
    s = torch.arange(1 << 16, dtype=torch.int64)
    if name == "mul1":
        # Sum of the 4 bytes of the 32-bit product, plus 1024, read as a float16 in [1024, 2044], then
        # h * 0.00677 - 10.39 in one float16 fma: exact in float32 (22 significant bits), rounded once.
        x = (s * MARKERS["mul1"]) & 0xFFFFFFFF
        h = sum((x >> sh) & 0xFF for sh in (0, 8, 16, 24)).float() + 1024.0
        k_inv, k_bias = (_fp16_bits(torch.tensor(v)).float() for v in (0x1EEE, 0xC931))
        return (h * k_inv + k_bias).to(torch.float16)
    if name == "mcg":
        x = (s * MARKERS["mcg"]) & 0xFFFFFFFF
    elif name == "3inst":
        x = (s * 89226354 + 64248484) & 0xFFFFFFFF
    else:
        raise ValueError(f"unknown EXL3 codebook {name!r} (one of {', '.join(CODEBOOKS)})")
    # lop3 0x6a = (x & 0x8fff8fff) ^ 0x3b603b60: two float16 halves with magnitudes in [0.125, 2), summed in float16
    # (their float32 sum is exact, so one rounding to float16 equals the GPU's half add).
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return (_fp16_bits(x & 0xFFFF).float() + _fp16_bits(x >> 16).float()).to(torch.float16)


@lru_cache(maxsize=None)
def codebook_std(name: str) -> float:
    """Standard deviation of a codebook over uniformly random states (what random trellis words decode to)."""
    return codebook(name).float().std().item()


def bits_of(trellis_words: int) -> float:
    """Bits per weight from the trellis' last dim (16 * K words per tile)."""
    k = trellis_words / TILE
    return int(k) if k.is_integer() else k


@lru_cache(maxsize=None)
def step_bits(bits: float) -> torch.Tensor:
    """The bits each of a tile's 256 trellis steps adds to the stream: K, or at a half-integer rate floor(K) and
    floor(K) + 1 alternating (the odd steps carry the extra bit)."""
    ka = int(bits)
    per_step = torch.full((STEPS,), ka, dtype=torch.int64)
    if bits != ka:
        per_step[1::2] += 1
    return per_step


@lru_cache(maxsize=None)
def _windows(bits: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each step: the stream words its 16-bit state spans (first, next) and how far to shift their 32 bits."""
    ends = step_bits(bits).cumsum(0)
    words = int(ends[-1]) // 16
    start = (ends - 16) % (16 * words)
    first = start // 16
    return first, (first + 1) % words, 16 - start % 16


@lru_cache(maxsize=None)
def _unscatter() -> torch.Tensor:
    """For each row-major tile position, the trellis step decoded there (the inverse of TILE_ORDER)."""
    return torch.argsort(TILE_ORDER)


def unpack_states(trellis: torch.Tensor) -> torch.Tensor:
    """int16 [..., 16 * K] -> the 256 16-bit states of each tile, int64 [..., 256], in trellis step order."""
    first, nxt, shift = (t.to(trellis.device) for t in _windows(bits_of(trellis.shape[-1])))
    mem = trellis.to(torch.int64) & 0xFFFF
    stream = mem.view(*mem.shape[:-1], -1, 2).flip(-1).reshape(mem.shape)  # undo the pairwise swap
    return (((stream[..., first] << 16) | stream[..., nxt]) >> shift) & 0xFFFF


@lru_cache(maxsize=None)
def _stream_layout(bits: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For each bit of a tile's stream: the step that adds it and how far to shift that step's value for it (the
    step's bits go most significant first)."""
    k = step_bits(bits)
    owner = torch.repeat_interleave(torch.arange(STEPS), k)
    offset = torch.arange(owner.numel()) - (k.cumsum(0) - k)[owner]
    return owner, k[owner] - 1 - offset


def pack_steps(values: torch.Tensor, bits: float) -> torch.Tensor:
    """The inverse of `unpack_states`' stream: each step's new bits int64 [..., 256] (step j's value < 2^k_j) ->
    the int16 trellis words [..., 16 * K], most significant bit first, each pair of words swapped."""
    owner, shift = (t.to(values.device) for t in _stream_layout(bits))
    stream = (values[..., owner] >> shift) & 1
    weights = 1 << torch.arange(15, -1, -1, device=values.device)
    words = (stream.view(*stream.shape[:-1], -1, 16) * weights).sum(-1)
    words = words.view(*words.shape[:-1], -1, 2).flip(-1).reshape(words.shape)
    return torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)


def decode_tiles(trellis: torch.Tensor, codebook_name: str) -> torch.Tensor:
    """The rotated weight T [in, out] in float32 (float16 codebook values)."""
    tk, tn, _ = trellis.shape
    steps = unpack_states(trellis)[..., _unscatter().to(trellis.device)]  # row-major tile order
    values = codebook(codebook_name).to(trellis.device)[steps].float()
    return values.view(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Sylvester-Hadamard transform of each 128-block of the last dim, as butterflies (a + b, a - b) so
    an element's value does not depend on the tensor's other dims."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // HAD, HAD)
    h = 1
    while h < HAD:
        y = y.view(y.shape[0], y.shape[1], HAD // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(shape)


def dequantize_tensors(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook_name: str) -> torch.Tensor:
    """Dense [out, in] float32 (see the module note for the arithmetic)."""
    t = decode_tiles(trellis, codebook_name).t()  # [out, in]
    t = fwht(fwht(t).t()).t()  # input side, then output side
    # suh * svh / 128 is exact in float32 (11-bit significands; 1/128 a power of two): one rounding per element.
    return (t * (svh.float().unsqueeze(1) * suh.float().unsqueeze(0) * (1.0 / HAD))).contiguous()


def marker(codebook_name: str) -> dict[str, torch.Tensor]:
    """The codebook marker tensor exllamav3 expects beside the trellis (none for 3INST)."""
    if codebook_name not in MARKERS:
        return {}
    v = MARKERS[codebook_name]
    return {codebook_name: torch.tensor(v - (1 << 32) if v >= 1 << 31 else v, dtype=torch.int32)}


def random_linear(out: int, inp: int, *, std: float, bits: float = 4, codebook_name: str = "mul1",
                  generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """EXL3 tensors of a random [out, in] linear whose dense weight has about `std` per element: random trellis words
    (every word sequence is a valid trellis), random signs in suh / svh, suh scaled by std / the codebook's std."""
    check_linear(out, inp, bits, codebook_name)
    words = int(TILE * bits)
    kw = dict(generator=generator, device=device)
    trellis = torch.randint(-(1 << 15), 1 << 15, (inp // TILE, out // TILE, words), dtype=torch.int16, **kw)

    def signs(n: int) -> torch.Tensor:
        return torch.randint(0, 2, (n,), **kw).to(torch.float32).mul_(2).sub_(1)

    suh = (signs(inp) * (std / codebook_std(codebook_name))).to(torch.float16)
    return {"trellis": trellis, "suh": suh, "svh": signs(out).to(torch.float16), **marker(codebook_name)}


def check_rate(bits: float, codebook_name: str) -> None:
    """Raise a ValueError unless exllamav3 has kernels for this bits-per-weight and codebook."""
    if codebook_name not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook_name!r} (one of {', '.join(CODEBOOKS)})")
    if not (bits in range(1, 9) or (bits in HALF_BITS and codebook_name == "mul1")):
        raise ValueError(f"EXL3 bits per weight must be 1..8, or 1.5 / 2.5 / 3.5 with the mul1 codebook; got {bits} "
                         f"({codebook_name})")


def check_linear(out: int, inp: int, bits: float, codebook_name: str) -> None:
    """Raise a ValueError unless an [out, in] linear can be EXL3 at this rate and codebook."""
    if out % HAD or inp % HAD:
        raise ValueError(f"EXL3 needs both dims to be multiples of {HAD} (Hadamard blocks); got [{out}, {inp}]")
    check_rate(bits, codebook_name)


class Exl3Codec(Codec):
    name = "exl3"
    quant_method = QUANT_METHOD
    required = frozenset({"trellis"})
    optional = frozenset({"suh", "svh", *MARKERS})

    def params(self, qcfg: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        if not {"suh", "svh"} <= set(shapes):
            raise ValueError("EXL3 tensor without suh / svh (the old bit-packed su / sv sign vectors are not "
                             "supported: re-convert with exllamav3 >= 0.0.5)")
        tk, tn, words = shapes["trellis"]
        cb = "mcg" if "mcg" in shapes else "mul1" if "mul1" in shapes else "3inst"
        bits = bits_of(words)
        check_linear(tn * TILE, tk * TILE, bits, cb)
        if tuple(shapes["suh"]) != (tk * TILE,) or tuple(shapes["svh"]) != (tn * TILE,):
            raise ValueError(f"EXL3 suh {tuple(shapes['suh'])} / svh {tuple(shapes['svh'])} do not fit a trellis of "
                             f"{tk} x {tn} tiles")
        return {"bits": bits, "codebook": cb}

    def logical_shape(self, shapes: Mapping[str, tuple[int, ...]], params: Params) -> tuple[int, int]:
        tk, tn, _ = shapes["trellis"]
        return int(tn) * TILE, int(tk) * TILE

    def tile(self, dim: int, params: Params) -> int:
        return HAD

    def cut(self, name: str, dim: int, part: slice, params: Params) -> Index | None:
        if name == "trellis":  # [in tiles, out tiles, words]
            tiles = slice(part.start // TILE, part.stop // TILE)
            return axis_index(1 - dim, tiles)
        if (name, dim) in (("svh", 0), ("suh", 1)):
            return (part,)
        return None

    def dequantize(self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int], params: Params) -> torch.Tensor:
        return dequantize_tensors(tensors["trellis"], tensors["suh"], tensors["svh"], params["codebook"])


CODEC = Exl3Codec()
