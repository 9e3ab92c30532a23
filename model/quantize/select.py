"""Which linears of a GLM-5.3-Flash checkpoint get which quantized format (used by `twinspark quantize`, by
`make-tiny --format exl3` and by the random-weight benchmark model, so all three quantize the same modules).

Kept dense whatever the recipe, as the released FP8 / EXL3 checkpoints do: embeddings and lm_head, the MoE router,
KDA's low-rank gate projections (f_a/f_b/g_a/g_b) and beta projection, the DSA indexer's key head and per-head
weights, the vision tower, and every tensor that is not a 2-D `.weight` (norms, convs, biases, mHC parameters).
A linear whose dims do not fit the format's tile (fp8 blocks, w4a16 groups, EXL3's 128) also stays dense.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("fp8", "w4a16", "exl3")
DENSE = "bf16"  # a recipe's name for "leave these modules dense"
ROUTED_EXPERTS = ".mlp.experts."
# (KDA's beta projection by its full name: "b_proj." alone also matched MLA's q_b_proj and kv_b_proj, which kept
# the largest attention input projection dense under every recipe)
_KEEP_DENSE = ("embed_tokens.", "lm_head.", ".mlp.gate.weight", "f_a_proj.", "f_b_proj.", "g_a_proj.", "g_b_proj.",
               "self_attn.b_proj.", "indexer.wk.", "indexer.weights_proj.")
EXL3_TILE = 128


@dataclass(frozen=True)
class Recipe:
    """experts: the routed experts' format; other: every other eligible linear's format (None = keep dense).
    block: fp8's square block edge (None = one scale per output channel) and w4a16's group size."""

    experts: str | None
    other: str | None
    block: int | None = 128
    exl3_bits: float = 4
    exl3_codebook: str = "mul1"

    @classmethod
    def parse(cls, spec: str, **kw) -> "Recipe":
        """"FMT" (every eligible linear) or "EXPERTS+OTHER" (e.g. "w4a16+fp8", "exl3+bf16")."""
        parts = spec.split("+")
        if len(parts) > 2 or any(p not in (*FORMATS, DENSE) for p in parts):
            raise ValueError(f"{spec!r}: expected FORMAT or EXPERTS+OTHER with formats from "
                             f"{', '.join((*FORMATS, DENSE))} (e.g. fp8, w4a16+fp8, exl3+bf16)")
        experts, other = parts[0], parts[-1]
        return cls(None if experts == DENSE else experts, None if other == DENSE else other, **kw)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for f in (self.experts, self.other) if f))

    def format_for(self, key: str, shape: tuple[int, ...]) -> str | None:
        """The format `key` (a stored tensor of `shape`) is stored in under this recipe; None = dense."""
        if len(shape) != 2 or not key.endswith(".weight") or key.startswith("model.visual."):
            return None
        if any(k in key for k in _KEEP_DENSE):
            return None
        fmt = self.experts if ROUTED_EXPERTS in key else self.other
        return fmt if fmt is not None and fits(fmt, shape, self.block) else None


def fits(fmt: str, shape: tuple[int, ...], block: int | None) -> bool:
    """Whether a [out, in] weight is whole tiles of `fmt` (so every tensor-parallel cut on them is possible)."""
    out, inp = shape
    if fmt == "fp8":
        return block is None or (out % block == 0 and inp % block == 0)
    if fmt == "w4a16":
        return inp % (block or 128) == 0
    return out % EXL3_TILE == 0 and inp % EXL3_TILE == 0
