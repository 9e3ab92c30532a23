"""Weight tiles in the activation dtype, from dense or quantized storage: what lets one GEMM and one grouped-MoE
kernel serve every weight format with the same fixed schedule.

Formats (storage as kernels/quant describes it; the torch twins are the codecs' `dequantize`):
- DENSE: the weight itself.
- FP8_BLOCK: e4m3 values with one fp32 scale per [SB_N, SB_K] block (`weight_scale_inv`).
- FP8_CHANNEL: e4m3 values with one fp32 scale per output row (`weight_scale`).
- INT4: symmetric 4-bit values, 8 per int32 along K (lowest nibble first, stored as q + 8), one fp16 scale per
  SB_K inputs of a row (`weight_packed`, `weight_scale`).
- INT: symmetric SB_N-bit values (2, 3, 4 or 8) as one little-endian bit stream per row along K (stored as
  q + 2^(SB_N - 1); a 3-bit value may straddle two words), one bf16 scale per SB_K inputs of a row
  (`weight_packed`, `weight_scale`: kernels/quant/intn.py). 2, 4 and 8 bits decode whole words as INT4 does (an
  int4 linear reads like W4A16); 3 bits decodes each element from its word(s); any BLOCK_K serves any group. It is
  the portable path (dense linears, Triton's interpreter, GPUs without humming-kernels): expert stacks run on
  humming-kernels' decode (kernels/gpu/int_moe.py).
- EXL3: exllamav3's trellis (kernels/quant/exl3.py): the tile is the rotated weight T [in, out] decoded per element
  from its 16x16 tile's int16 words (SB_N = the codebook, SB_K = words per tile = 16 x bits), in float16 codebook
  values; the kernels rotate the activations around it (kernels/gpu/hadamard.py), so the product is the twin's
  within float16 / float32 rounding, not bit for bit. The decoded tile itself equals the twin's `decode_tiles`.
A fp8 / int4 tile is dequantized exactly as the twin dequantizes (value x scale in fp32, then rounded to the
activation dtype), so a quantized product equals the same kernel's product with the twin's dequantized weights, bit
for bit: the formats change the bytes read, never the arithmetic schedule (docs/design.md §5.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import triton
import triton.language as tl


class Fmt(IntEnum):
    DENSE = 0
    FP8_BLOCK = 1
    FP8_CHANNEL = 2
    INT4 = 3
    EXL3 = 4
    INT = 5


# EXL3 codebook ids (SB_N of an EXL3 tile read)
EXL3_CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}


@dataclass(frozen=True)
class WeightArgs:
    """What a kernel needs to read one weight (or a stack of them: dim 0 = expert / batch)."""
    fmt: Fmt
    data: torch.Tensor  # [B, N, K] dense or e4m3, [B, N, K / 8] int32 words, or EXL3 [B, K/16, N/16, words] int16
    scale: torch.Tensor  # [B, ...] scales (any tensor for DENSE and EXL3: never read)
    block_n: int = 1  # scale block rows (FP8_BLOCK); EXL3: the codebook id; INT: bits per weight
    block_k: int = 1  # scale block / group columns (FP8_BLOCK, INT4, INT); EXL3: trellis words per 16x16 tile
    suh: torch.Tensor | None = None  # EXL3 [B, K] float16: input signs and scales
    svh: torch.Tensor | None = None  # EXL3 [B, N] float16: output signs

    @property
    def n(self) -> int:
        return self.data.shape[2] * 16 if self.fmt is Fmt.EXL3 else self.data.shape[1]

    @property
    def k(self) -> int:
        if self.fmt is Fmt.EXL3:
            return self.data.shape[1] * 16
        if self.fmt is Fmt.INT:
            return self.data.shape[2] * 32 // self.block_n
        return self.data.shape[2] * (8 if self.fmt is Fmt.INT4 else 1)

    def strides(self) -> tuple[int, int, int, int, int, int]:
        """(data batch, data n, data k, scale batch, scale n, scale k) element strides; EXL3: (batch, N tile,
        K tile, 0, 0, 0), its words contiguous."""
        d, s = self.data, self.scale
        if self.fmt is Fmt.DENSE:
            return d.stride(0), d.stride(1), d.stride(2), 0, 0, 0
        if self.fmt is Fmt.EXL3:
            return d.stride(0), d.stride(2), d.stride(1), 0, 0, 0
        sk = s.stride(2) if s.dim() == 3 else 0
        return d.stride(0), d.stride(1), d.stride(2), s.stride(0), s.stride(1), sk

    def max_block_k(self) -> int:
        """The widest K step a kernel may take: one scale block / group per step."""
        return self.block_k if self.fmt in (Fmt.FP8_BLOCK, Fmt.INT4) else 1 << 30


def dense(w: torch.Tensor) -> WeightArgs:
    """A dense weight [N, K] or a stack [B, N, K]."""
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    return WeightArgs(Fmt.DENSE, w3, w3)


def quantized(fmt_name: str, tensors: dict[str, torch.Tensor], params: dict) -> WeightArgs:
    """A quantized weight (kernels/quant's stored tensors and parameters), one [N, K] or a stack [B, N, K]."""
    def three(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 3 else t.unsqueeze(0)
    if fmt_name == "fp8":
        if params.get("block") is not None:
            bn, bk = params["block"]
            return WeightArgs(Fmt.FP8_BLOCK, three(tensors["weight"]), three(tensors["weight_scale_inv"]), bn, bk)
        scale = tensors["weight_scale"]
        scale = scale.reshape(*scale.shape[:-1], 1) if scale.shape[-1] != 1 else scale
        return WeightArgs(Fmt.FP8_CHANNEL, three(tensors["weight"]), three(scale))
    if fmt_name == "w4a16":
        return WeightArgs(Fmt.INT4, three(tensors["weight_packed"]), three(tensors["weight_scale"]), 1,
                          int(params["group"]))
    if fmt_name == "int":
        return WeightArgs(Fmt.INT, three(tensors["weight_packed"]), three(tensors["weight_scale"]),
                          int(params["bits"]), int(params["group"]))
    if fmt_name == "exl3":
        trellis = tensors["trellis"]
        trellis = (trellis if trellis.dim() == 4 else trellis.unsqueeze(0)).contiguous()
        suh, svh = (t if t.dim() == 2 else t.unsqueeze(0) for t in (tensors["suh"], tensors["svh"]))
        return WeightArgs(Fmt.EXL3, trellis, trellis, EXL3_CODEBOOKS[params["codebook"]], trellis.shape[-1],
                          suh.contiguous(), svh.contiguous())
    raise NotImplementedError(f"no GPU kernel reads {fmt_name!r} weights")


@triton.jit
def exl3_tile(w_ptr, rn, k0, N, K, stn, stk, CB: tl.constexpr, WORDS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of EXL3's rotated weight T (rows = inputs k0.., columns = outputs rn) in float16,
    decoded per element as kernels/quant/exl3.py's `decode_tiles` does (0 outside T)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    valid = (kk[:, None] < K) & (rn[None, :] < N)
    r = kk[:, None] % 16
    c = rn[None, :] % 16
    # The trellis step stored at tile position (r, c): the inverse of exllamav3's tensor-core order (TILE_ORDER).
    step = 8 * ((c % 8) * 4 + (r % 8) // 2) + (c // 8) * 4 + (r % 2) + 2 * (r // 8)
    # Step j's 16-bit state is the window of the tile's bit stream ending where step j's bits end; half-integer
    # rates (WORDS an odd multiple of 8) give odd steps one more bit.
    end = (step + 1) * (WORDS // 16)
    if WORDS % 16 != 0:
        end += (step + 1) // 2
    start = (end - 16 + WORDS * 16) % (WORDS * 16)
    first = start // 16
    nxt = (first + 1) % WORDS
    base = w_ptr + (kk // 16)[:, None] * stk + (rn // 16)[None, :] * stn
    # Words are stored pairwise swapped (exllamav3 reads big-endian 32-bit words): stream word i = stored i ^ 1.
    hi = tl.load(base + (first ^ 1), mask=valid, other=0).to(tl.uint32) & 0xFFFF
    lo = tl.load(base + (nxt ^ 1), mask=valid, other=0).to(tl.uint32) & 0xFFFF
    state = (((hi << 16) | lo) >> (16 - start % 16).to(tl.uint32)) & 0xFFFF
    if CB == 2:  # mul1: byte sum of the 32-bit product, + 1024, times 0x1EEE + 0xC931 (float16 constants)
        x = (state * 0x83DCD12D) & 0xFFFFFFFF  # 32-bit wrap whatever the literal's type
        h = ((x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)).to(tl.float32) + 1024.0
        value = (h * 0.00676727294921875 + -10.3828125).to(tl.float16)  # exact product: fma or not, same bits
    else:  # 3inst / mcg: two float16 halves of a masked hash, summed (exact in float32, rounded once)
        if CB == 1:
            x = (state * 0xCBAC1FED) & 0xFFFFFFFF
        else:
            x = (state * 89226354 + 64248484) & 0xFFFFFFFF
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        a = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        b = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        value = (a + b).to(tl.float16)
    return tl.where(valid, value, 0.0)


@triton.jit
def int_tile(w_ptr, s_ptr, rn, k0, N, K, swn, swk, ssn, ssk, BITS: tl.constexpr, GROUP: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of an INT weight's W^T (rows = inputs k0.., columns = outputs rn) in float32,
    q * scale exactly as kernels/quant/intn.py's dequantize computes it (0 outside W). Widths that divide a word
    (2, 4, 8 bits) read BLOCK_K * BITS / 32 whole words per column and shift the codes out, as the INT4 tile does;
    3 bits reads the same words, 3 for every 32 codes, and takes each code from its word (and the next, where it
    straddles two); BLOCK_K a multiple of 32 then. One scale row per K step when the step lies within a group, else
    each element's own."""
    kk = k0 + tl.arange(0, BLOCK_K)
    valid = (kk[:, None] < K) & (rn[None, :] < N)
    row = w_ptr + rn[None, :] * swn
    if 32 % BITS == 0:
        PER: tl.constexpr = 32 // BITS
        kw = k0 // PER + tl.arange(0, BLOCK_K // PER)
        words = tl.load(row + kw[:, None] * swk, mask=(rn[None, :] < N) & (kw[:, None] < K // PER), other=0)
        words = words.to(tl.uint32, bitcast=True)
        code = tl.reshape((words[:, None, :] >> (tl.arange(0, PER) * BITS).to(tl.uint32)[None, :, None]),
                          (BLOCK_K, BLOCK_N))
    else:
        # 32 codes fill BITS whole words (a period): load each word of the tile's periods once, as [periods,
        # BLOCK_N], and pick every code's word(s) and shift by its place in the period (a select per word, in
        # registers: a load per code built [BLOCK_K, BLOCK_N] pointer tensors that took Triton 176-428 KiB of
        # shared memory).
        PERIODS: tl.constexpr = BLOCK_K // 32
        p = tl.arange(0, PERIODS)
        first = tl.arange(0, 32) * BITS  # each code's first bit in its period
        word = (first // 32)[None, :, None]
        shift = (first % 32).to(tl.uint32)[None, :, None]
        lo = tl.zeros((PERIODS, 32, BLOCK_N), dtype=tl.uint32)
        hi = tl.zeros((PERIODS, 32, BLOCK_N), dtype=tl.uint32)
        inside = (rn[None, :] < N) & ((k0 + p * 32)[:, None] < K)
        for j in tl.static_range(BITS):
            w = tl.load(row + ((k0 // 32 + p) * BITS + j)[:, None] * swk, mask=inside, other=0)
            w = w.to(tl.uint32, bitcast=True)[:, None, :]
            lo = tl.where(word == j, w, lo)
            hi = tl.where(word + 1 == j, w, hi)  # the next word, where a code straddles two
        spill = (first % 32 + BITS > 32)[None, :, None]
        code = tl.reshape((lo >> shift) | tl.where(spill, hi << (32 - shift), 0), (BLOCK_K, BLOCK_N))
    q = (code & ((1 << BITS) - 1)).to(tl.int32) - (1 << (BITS - 1))
    if GROUP % BLOCK_K == 0:
        s = tl.load(s_ptr + rn[None, :] * ssn + (k0 // GROUP) * ssk, mask=rn[None, :] < N, other=0.0)
    else:
        s = tl.load(s_ptr + rn[None, :] * ssn + (kk[:, None] // GROUP) * ssk, mask=valid, other=0.0)
    return tl.where(valid, q.to(tl.float32) * s.to(tl.float32), 0.0)


@triton.jit
def weight_tile(w_ptr, s_ptr, rn, k0, N, K, swn, swk, ssn, ssk, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr, act: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of W^T at rows k0.. and columns rn, in the activation dtype (0 outside W).
    w_ptr / s_ptr point at this weight's (or expert's) data and scales."""
    kk = k0 + tl.arange(0, BLOCK_K)
    col = rn[None, :] < N
    if FMT == 4:  # EXL3: the trellis tile in the operand dtype (float16 values: exact in float16 and float32)
        tile = exl3_tile(w_ptr, rn, k0, N, K, swn, swk, SB_N, SB_K, BLOCK_K).to(act)
    elif FMT == 5:  # INT: SB_N-bit codes from each row's bit stream, each element with its own group's scale
        tile = int_tile(w_ptr, s_ptr, rn, k0, N, K, swn, swk, ssn, ssk, SB_N, SB_K, BLOCK_K, BLOCK_N).to(act)
    elif FMT == 3:  # INT4: BLOCK_K / 8 words per column, unpacked to nibbles along K
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + rn[None, :] * swn + kw[:, None] * swk, mask=col & (kw[:, None] < K // 8), other=0)
        nib = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
        q = tl.reshape(nib, (BLOCK_K, BLOCK_N)) - 8
        s = tl.load(s_ptr + rn[None, :] * ssn + (k0 // SB_K) * ssk, mask=col, other=0.0).to(tl.float32)
        tile = (q.to(tl.float32) * s).to(act)
    else:
        raw = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=col & (kk[:, None] < K), other=0.0)
        if FMT == 0:
            tile = raw
        else:
            if FMT == 1:  # FP8_BLOCK
                s = tl.load(s_ptr + (rn // SB_N)[None, :] * ssn + (k0 // SB_K) * ssk, mask=col, other=0.0)
            else:  # FP8_CHANNEL
                s = tl.load(s_ptr + rn[None, :] * ssn, mask=col, other=0.0)
            tile = (raw.to(tl.float32) * s).to(act)
    return tile


def stack_quantized(parts: list) -> WeightArgs:
    """One WeightArgs over a list of same-format quantized weights (kernels/quant's QuantizedWeight: `format`,
    `tensors`, `params`), stacked along a new first dim (the experts of a MoE)."""
    first = parts[0]
    if any(p.format != first.format or dict(p.params) != dict(first.params) or p.shape != first.shape
           for p in parts):
        raise ValueError("stacked weights must share one format, its parameters and their shape")
    tensors = {name: torch.stack([p.tensors[name] for p in parts]) for name in first.tensors}
    return quantized(first.format, tensors, dict(first.params))


def cat(parts: list[WeightArgs], dim: int) -> WeightArgs:
    """Same-format weights joined along the batch (0) or the N (1) dim: data and scales alike (along N every part
    must be whole scale blocks, so each keeps its own scales)."""
    first = parts[0]
    if first.fmt is Fmt.EXL3:
        return _cat_exl3(parts, dim)
    if any(p.fmt != first.fmt or p.block_n != first.block_n or p.block_k != first.block_k for p in parts):
        raise ValueError("joined weights must share one format and its block sizes")
    if dim == 1 and first.fmt is Fmt.FP8_BLOCK and any(p.n % first.block_n for p in parts):
        raise ValueError(f"a part of {[p.n for p in parts]} rows is not whole {first.block_n}-row scale blocks")
    if len(parts) == 1:
        return first
    data = torch.cat([p.data for p in parts], dim=dim)
    scale = data if first.fmt is Fmt.DENSE else torch.cat([p.scale for p in parts], dim=dim)
    return WeightArgs(first.fmt, data, scale, first.block_n, first.block_k)


def _cat_exl3(parts: list[WeightArgs], dim: int) -> WeightArgs:
    """EXL3 stacks one after another (dim 0: the virtual shards' expert blocks), their Hadamard vectors alike. Not
    along N: a 16-column trellis tile and a 128-point rotation block would straddle two linears' vectors."""
    first = parts[0]
    if dim != 0:
        raise ValueError("EXL3 weights are joined along the batch dim only")
    if any(p.fmt is not Fmt.EXL3 or p.block_n != first.block_n or p.block_k != first.block_k
           or p.data.shape[1:] != first.data.shape[1:] for p in parts):
        raise ValueError("joined EXL3 weights must share one codebook, bitrate and shape")
    if len(parts) == 1:
        return first
    data = torch.cat([p.data for p in parts])
    return WeightArgs(Fmt.EXL3, data, data, first.block_n, first.block_k, torch.cat([p.suh for p in parts]),
                      torch.cat([p.svh for p in parts]))
