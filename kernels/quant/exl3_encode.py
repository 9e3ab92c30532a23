"""EXL3 encoding in torch: a dense [out, in] weight -> trellis / suh / svh / codebook marker that exl3.py (and
exllamav3) decode. It runs on the CPU (or any torch device) with no calibration data, so `twinspark quantize` can
write EXL3 anywhere; exllamav3's own converter (Hessian-weighted LDLQ, an exact Viterbi search on the GPU) gives a
lower error, this one a valid file of the same layout.

1. Scales (the decode's diag(svh) . H . T^T . H . diag(suh) / 128, inverted): svh = random signs x each output row's
   RMS; after the output-side Hadamard, suh = random signs x each input column's RMS / (FILL x the codebook's
   spread), so the rotated weight T has about the codebook's distribution. Both are rounded to float16 before T is
   computed from them, so the decode meets exactly the scales T was fitted with.
2. Each 16x16 tile of T, in trellis step order, is a sequence of 256 values to code. A step's 16-bit state is the
   previous state shifted left by the step's k bits plus k new bits, and the sequence is circular (step 0's state
   holds the tile's last 16 - k bits). Encoding is a beam search (the M-algorithm): the `beam` cheapest partial
   paths survive each step. The circle is closed in two passes: pass 1 starts from the states nearest the first
   value with any wrap bits; its best end state fixes the wrap bits, and pass 2 searches again with the first
   state's high bits set to them and the last steps forced to write them, so its best path is a valid circle.
"""

from __future__ import annotations

import torch

from kernels.quant import exl3

BEAM = 32  # paths kept per tile (error at 3 bpw: beam 16 +20%, beam 64 -10%; time grows with it)
FILL = 0.9  # the rotated weight's spread / the codebook's: the beam's error is lowest a little under 1 (measured)
# Tiles searched at once (memory: 256 steps x chunk x BEAM back-pointers of 3 bytes). Every op of the search is
# row-wise, so a tile's path does not depend on the chunk it is searched in. On the CPU small chunks stay in cache; on
# a GPU each of the search's thousands of small launches per chunk costs about the same whatever its size, so a chunk
# there must be large for the launches to carry work (at 2,048 tiles the GPU encoder was launch-bound:
# docs/benchmarks.md, "Host work").
CHUNK = 2048
GPU_CHUNK = 32768  # ~0.8 GB of back-pointers at beam 32


def quantize(w: torch.Tensor, bits: float, codebook_name: str = "mul1", *, generator: torch.Generator | None = None,
             beam: int = BEAM) -> dict[str, torch.Tensor]:
    """EXL3 tensors of a dense [out, in] weight (both dims multiples of 128) at `bits` per weight."""
    out, inp = w.shape
    exl3.check_linear(out, inp, bits, codebook_name)
    w = w.float()
    kw = dict(generator=generator, device="cpu")
    su, sv = (torch.randint(0, 2, (n,), **kw).float().mul_(2).sub_(1).to(w.device) for n in (inp, out))
    svh = (sv * _rms(w, 1)).half()
    # The output-side rotation first (orthonormal: H / sqrt(128)), so the input scales see the rows they divide.
    norm = exl3.HAD ** -0.5
    mixed = exl3.fwht((w / svh.float().unsqueeze(1)).t()).t() * norm
    suh = (su * _rms(mixed, 0) / (FILL * exl3.codebook_std(codebook_name))).half()
    tt = exl3.fwht(mixed / suh.float().unsqueeze(0)) * norm  # T^T [out, in]
    tiles = tt.t().reshape(inp // exl3.TILE, exl3.TILE, out // exl3.TILE, exl3.TILE).permute(0, 2, 1, 3)
    seq = tiles.reshape(-1, exl3.STEPS)[:, exl3.TILE_ORDER.to(w.device)]
    chunk = CHUNK if w.device.type == "cpu" else GPU_CHUNK
    values = torch.cat([encode(part, bits, codebook_name, beam) for part in seq.split(chunk)])
    trellis = exl3.pack_steps(values, bits).view(inp // exl3.TILE, out // exl3.TILE, -1)
    return {"trellis": trellis, "suh": suh, "svh": svh, **exl3.marker(codebook_name)}


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    """RMS along `dim`, floored so an all-zero row or column divides by a float16 normal number."""
    r = x.square().mean(dim).sqrt()
    return r.clamp_min(max(float(r.max()) * 1e-3, 2.0 ** -14))


def encode(x: torch.Tensor, bits: float, codebook_name: str, beam: int = BEAM) -> torch.Tensor:
    """Tiles [T, 256] (trellis step order) -> each step's new bits int64 [T, 256] of a circular path (see the
    module note)."""
    cb = exl3.codebook(codebook_name).to(x.device).float()
    k = exl3.step_bits(bits).tolist()
    # One CPU thread: each op of the search is small (T x beam x 2^k elements), and intra-op threads cost more in
    # hand-offs than they save (7x the CPU time with 2 threads, measured).
    threads = torch.get_num_threads()
    if x.device.type == "cpu":
        torch.set_num_threads(1)
    try:
        first, _, _ = _search(x, cb, k, beam, wrap=None)
        wrap = first & ((1 << (16 - k[0])) - 1)  # the stream's last 16 - k0 bits, which step 0's state begins with
        _, values, _ = _search(x, cb, k, beam, wrap=wrap)
    finally:
        torch.set_num_threads(threads)
    return values


def _search(x: torch.Tensor, cb: torch.Tensor, k: list[int], beam: int,
            wrap: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One beam pass over every tile: (the best path's end state [T], its step values [T, 256], its squared error
    [T]). wrap None: step 0 may take any state and no path is kept (its values would not close the circle); else
    each tile's wrap bits [T], held to."""
    t, dev = x.shape[0], x.device
    if wrap is None:
        states = _nearest(x[:, 0], cb, beam)
    else:
        states = (wrap.unsqueeze(1) << k[0]) | torch.arange(1 << k[0], device=dev)
    states, costs = _first_beam(states, (x[:, :1] - cb[states]).square(), beam)
    tail = _tail_masks(k) if wrap is not None else {}
    # Back-pointers, small: a path's parent slot (int16) and the bits its step added (uint8, k <= 8).
    parents, picks = [], [(states & ((1 << k[0]) - 1)).to(torch.uint8)]
    for j in range(1, exl3.STEPS):
        v = torch.arange(1 << k[j], device=dev)
        cand = ((states.unsqueeze(2) << k[j]) | v) & 0xFFFF  # [T, beam, 2^k]
        c = costs.unsqueeze(2) + (x[:, j, None, None] - cb[cand]).square()
        if j in tail:  # a step that writes wrap bits: only values whose bits match them
            mask, shift = tail[j]
            c = torch.where(((v ^ (wrap.view(t, 1, 1) >> shift)) & mask) == 0, c, torch.inf)
        order = _cheapest(c.view(t, -1), beam)
        costs, states = c.view(t, -1).gather(1, order), cand.view(t, -1).gather(1, order)
        if wrap is not None:
            parents.append((order >> k[j]).to(torch.int16))
            picks.append((order & ((1 << k[j]) - 1)).to(torch.uint8))
    best = costs.argmin(1, keepdim=True)
    end, cost = states.gather(1, best).squeeze(1), costs.gather(1, best).squeeze(1)
    if wrap is None:
        return end, None, cost
    values = torch.empty(t, exl3.STEPS, dtype=torch.int64, device=dev)
    slot = best
    for j in range(exl3.STEPS - 1, 0, -1):
        values[:, j] = picks[j].gather(1, slot).squeeze(1).long()
        slot = parents[j - 1].gather(1, slot).long()
    values[:, 0] = picks[0].gather(1, slot).squeeze(1).long()
    return end, values, cost


def _cheapest(c: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the `n` smallest costs of each row, ties broken by index: the key (cost's float32 bits, which
    order like the non-negative floats they encode, then the index) is unique, so any top-k algorithm picks alike."""
    key = (c.view(torch.int32).long() << 16) | torch.arange(c.shape[1], device=c.device)
    return torch.topk(key, n, dim=1, largest=False).indices  # sorted: the slot order is the key order too


def _nearest(x0: torch.Tensor, cb: torch.Tensor, n: int) -> torch.Tensor:
    """For each value, `n` states whose codebook values are nearest it (sorted codebook, a window around x0)."""
    vals, idx = torch.sort(cb, stable=True)
    pos = torch.searchsorted(vals, x0.contiguous()).clamp(n, vals.numel() - n)
    window = pos.unsqueeze(1) + torch.arange(-n, n, device=x0.device)
    near = torch.sort((vals[window] - x0.unsqueeze(1)).abs(), dim=1, stable=True).indices[:, :n]
    return idx[window.gather(1, near)]


def _first_beam(states: torch.Tensor, costs: torch.Tensor, beam: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's candidates as a beam of `beam` paths: the cheapest, or all of them widened with unreachable
    (infinite-cost) copies when there are fewer (2^k0 after fixed wrap bits)."""
    short = beam - states.shape[1]
    if short <= 0:
        order = _cheapest(costs, beam)
        return states.gather(1, order), costs.gather(1, order)
    return (torch.cat([states, states[:, :1].expand(-1, short)], 1),
            torch.cat([costs, torch.full_like(costs[:, :1], torch.inf).expand(-1, short)], 1))


def _tail_masks(k: list[int]) -> dict[int, tuple[int, int]]:
    """The last steps, whose bits are the stream's final 16 - k0 (the wrap bits): step -> (mask over the step's
    value of the bits that must match, shift that brings the wrap bits of those positions under them)."""
    need, end, out = 16 - k[0], sum(k), {}
    pos = end
    for j in range(exl3.STEPS - 1, -1, -1):
        start = pos - k[j]
        # stream position q (within the last `need` bits) is wrap bit end - 1 - q and value bit pos - 1 - q
        lo = max(start, end - need)
        if lo >= pos:
            break
        mask = ((1 << (pos - lo)) - 1)  # value bits 0 .. pos - lo - 1 (the step's lowest) are wrap bits
        out[j] = (mask, end - pos)
        pos = start
    return out
