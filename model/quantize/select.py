"""Which linears of a GLM-5.3-Flash checkpoint get which quantized format (used by `twinspark quantize`, by
`make-tiny --format exl3` and by the random-weight benchmark model, so all three quantize the same modules).

Kept dense whatever the recipe, as the released FP8 / EXL3 checkpoints do: the embeddings, the MoE router, KDA's
low-rank gate projections (f_a/f_b/g_a/g_b) and beta projection, the DSA indexer's key head and per-head weights,
the vision tower, and every tensor that is not a 2-D `.weight` (norms, convs, biases, mHC parameters); lm_head too
unless the recipe's third term (HEAD) asks for fp8. A linear also stays dense unless it is whole tiles of the format
(fp8 blocks, w4a16 / int groups, EXL3's 128) on every virtual shard the loader cuts it into (`fits`), so a quantized
checkpoint loads at every TP size that divides the virtual shard count; an fp8 lm_head that is not is refused
(`format_for`), not left dense, since the recipe named it alone.

A recipe names formats as the user types them: fp8, w4a16, exl3 (EXL3 at a target bitrate, exl3:BITS), and the int
formats by their width, int2 / int3 / int4 / int8 (one group size per recipe: int3:g64, else the recipe's block);
`codec_format` turns such a name into the codec that stores it (kernels/quant: "int3" is the "int" codec at 3 bits).
This module imports no torch (the CLI's --help reads it), so it names the int widths itself; intn.BITS is the
codec's list and a test holds the two equal.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

INT_FORMATS = ("int2", "int3", "int4", "int8")
INT_CODEC = "int"  # the codec (kernels/quant/intn.py) of every int format
FORMATS = ("fp8", "w4a16", "exl3", *INT_FORMATS)
DENSE = "bf16"  # a recipe's name for "leave these modules dense"
ROUTED_EXPERTS = ".mlp.experts."
# (KDA's beta projection by its full name: "b_proj." alone also matched MLA's q_b_proj and kv_b_proj, which kept
# the largest attention input projection dense under every recipe)
_KEEP_DENSE = ("embed_tokens.", ".mlp.gate.weight", "f_a_proj.", "f_b_proj.", "g_a_proj.", "g_b_proj.",
               "self_attn.b_proj.", "indexer.wk.", "indexer.weights_proj.")
EXL3_TILE = 128
EXL3_DEFAULT_BITS = 4.0
EXL3_BITS_RANGE = (1.0, 8.0)  # exllamav3's: 1..8 bits per weight
VIRTUAL_SHARDS = 4  # the rank worker's default (--virtual-shards)
LM_HEAD = "lm_head.weight"
# The formats a recipe's HEAD may store lm_head in. lm_head is one [vocab, hidden] product every decode step (1.27 GB
# of bf16 at the release's dims, more than half of the non-expert bytes a batch-1 step reads), and fp8 in 128 x 128
# blocks is the one format with a fast product at that shape: humming's dense fp8 GEMM (--rest-fp8-kernel humming)
# streams wide fp8 products close to the copy rate and our Triton GEMM not far below, while the 4-bit tiles run on
# our GEMM only, far below it (docs/benchmarks.md, "The rest on humming's dense GEMM (one H100, a probe)").
HEAD_FORMATS = ("fp8",)
BLOCKS = (128, 64, 32, 16, 8)  # the fp8 blocks / w4a16 and int groups `auto_block` chooses from
RECIPE_HELP = ("FORMAT for every eligible linear, or EXPERTS+OTHER[+HEAD], from fp8, w4a16, exl3[:BITS], int2, int3, "
               "int4, int8 (each with an optional :gGROUP), bf16 (e.g. fp8, w4a16+fp8, exl3:3.0+fp8, exl3:2.5+bf16, "
               "int3+int4, int3:g64+fp8, int3+fp8+fp8); BITS is EXL3's average bits per weight, 1-8 (half steps "
               "too; default 4): each linear gets a whole or half rate so the average lands on it; GROUP is the int "
               "formats' group size, one per recipe (default: the block size), a multiple of 32 at 3 bits; HEAD is "
               "lm_head's format, bf16 (the default) or fp8 in the recipe's fp8 blocks")

# How the model cuts each linear over the virtual shards (the reader.split / reader.full calls of model/ffn.py,
# kda_attention.py, mla_attention.py and mtp.py), by the linear's name: the dims a shard boundary falls in.
_ROW_PARALLEL = {"down_proj", "o_proj"}  # cut along the input dim
_COLUMN_PARALLEL = {"gate_proj", "up_proj", "q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "lm_head"}
_REPLICATED = {"q_a_proj", "kv_a_proj_with_mqa", "eh_proj", "wq_b"}  # read whole on every rank


@dataclass(frozen=True)
class FormatSpec:
    """One format as typed: its name (a FORMATS entry or bf16) and its option, EXL3's target bits per weight
    (exl3:3.0) or an int format's group size (int3:g64)."""

    name: str
    exl3_bits: float | None = None
    group: int | None = None


def parse_format(spec: str) -> FormatSpec:
    """"fp8", "w4a16", "bf16", "exl3[:BITS]" or "int2|int3|int4|int8[:gGROUP]"."""
    name, sep, option = spec.partition(":")
    if name not in (*FORMATS, DENSE):
        raise ValueError(f"{spec!r}: expected a format from {', '.join((*FORMATS, DENSE))} (exl3 optionally with "
                         f":BITS, e.g. exl3:3.0; an int format with :gGROUP, e.g. int3:g64), or EXPERTS+OTHER of two "
                         f"of them (+HEAD: lm_head's, bf16 or fp8)")
    if not sep:
        return FormatSpec(name)
    if name in INT_FORMATS:
        if not (option.startswith("g") and option[1:].isdigit() and int(option[1:]) > 0):
            raise ValueError(f"{spec!r}: an int format takes its group size as :gGROUP (e.g. {name}:g64, "
                             f"{name}:g128)")
        return FormatSpec(name, group=int(option[1:]))
    if name != "exl3":
        raise ValueError(f"{spec!r}: only exl3 takes a bitrate (exl3:BITS), and only the int formats a group size "
                         f"(int3:g64)")
    try:
        value = float(option)
    except ValueError:
        value = math.nan
    check_exl3_bits(value, f"{spec!r}: ")
    return FormatSpec(name, exl3_bits=value)


def codec_format(fmt: str) -> tuple[str, int | None]:
    """A recipe's format name -> (the codec that stores it, the int bits): "int3" -> ("int", 3), "fp8" -> ("fp8",
    None)."""
    if fmt in INT_FORMATS:
        return INT_CODEC, int(fmt.removeprefix("int"))
    return fmt, None


def check_exl3_bits(bits: float, what: str = "") -> None:
    """Raise a ValueError for an EXL3 target outside exllamav3's range (nan included)."""
    lo, hi = EXL3_BITS_RANGE
    if not lo <= bits <= hi:
        raise ValueError(f"{what}EXL3 bits per weight must be a number from {lo:g} to {hi:g} (e.g. exl3:2.0, "
                         f"exl3:2.5, exl3:3.0, exl3:4.0)")


def format_and_bits(spec: str, bits: float | None) -> FormatSpec:
    """A CLI's --format (FORMAT, exl3:BITS or intN:gGROUP) with its older --bits flag folded in (the same as
    exl3:BITS)."""
    fmt = parse_format(spec)
    if bits is None:
        return fmt
    if fmt.name != "exl3":
        raise ValueError(f"--bits is EXL3's bits per weight; --format is {spec}")
    if fmt.exl3_bits is not None and fmt.exl3_bits != bits:
        raise ValueError(f"--format {spec} and --bits {bits:g} disagree (give one)")
    return parse_format(f"exl3:{bits}")


def recipe_and_bits(spec: str, bits: float | None, **kw) -> "Recipe":
    """A CLI's --format recipe with the older --bits flag folded into its EXL3 terms (`format_and_bits` per term);
    kw: Recipe's settings."""
    terms = spec.split("+")
    if bits is not None:
        if all(parse_format(t).name != "exl3" for t in terms):
            raise ValueError(f"--bits is EXL3's bits per weight; --format is {spec}")
        terms = [t if parse_format(t).name != "exl3" else f"exl3:{format_and_bits(t, bits).exl3_bits}" for t in terms]
    return Recipe.parse("+".join(terms), **kw)


def cut_dims(key: str) -> tuple[int, ...]:
    """The dims of linear `key` that tensor parallelism cuts into virtual shards (0 = out, 1 = in); both for a
    linear this table does not know, so it is only quantized when any cut would land on the tile grid."""
    name = key.removesuffix(".weight").rpartition(".")[2]
    if name in _REPLICATED:
        return ()
    if name in _ROW_PARALLEL:
        return (1,)
    if name in _COLUMN_PARALLEL:
        return (0,)
    return (0, 1)


@dataclass(frozen=True)
class Recipe:
    """experts: the routed experts' format; other: every other eligible linear's format (None = keep dense); head:
    lm_head's (None = keep dense, else one of HEAD_FORMATS).
    block: fp8's square block edge (None = one scale per output channel), w4a16's group size, and the int formats'
    unless `group` is set (a recipe's int3:g64). exl3_bits: EXL3's target average bits per weight
    (model/quantize/bits.py spreads it over the linears). virtual: the virtual shards the checkpoint is planned for
    (a linear is quantized only if each shard is whole tiles)."""

    experts: str | None
    other: str | None
    block: int | None = 128
    exl3_bits: float = EXL3_DEFAULT_BITS
    exl3_codebook: str = "mul1"
    virtual: int = VIRTUAL_SHARDS
    group: int | None = None
    head: str | None = None

    def __post_init__(self) -> None:
        if self.head not in (None, *HEAD_FORMATS):
            raise ValueError(f"HEAD {self.head}: lm_head is kept {DENSE} or stored in {' / '.join(HEAD_FORMATS)}, the "
                             f"one format with a fast product at lm_head's [vocab, hidden] shape today (humming's "
                             f"dense fp8 GEMM; the 4-bit tiles would run it on our GEMM far below the copy rate: "
                             f"docs/quantization.md, Recipes)")
        ints = [f for f in self.formats if codec_format(f)[0] == INT_CODEC]
        if ints:
            from kernels.quant import intn  # only here: the CLI's --help imports this module, and intn imports torch

            for fmt in ints:
                intn.check_group(codec_format(fmt)[1], self.block_for(fmt) or intn.DEFAULT_GROUP)

    @classmethod
    def parse(cls, spec: str, **kw) -> "Recipe":
        """"FMT" (every eligible linear), "EXPERTS+OTHER" (e.g. "w4a16+fp8", "exl3:3.0+bf16", "int3:g64+int4") or
        "EXPERTS+OTHER+HEAD" (e.g. "int3+fp8+fp8": lm_head in fp8 too)."""
        parts = spec.split("+")
        if len(parts) > 3:
            raise ValueError(f"{spec!r}: expected {RECIPE_HELP}")
        parsed = [parse_format(p) for p in parts]
        rates = {f.exl3_bits for f in parsed if f.exl3_bits is not None}
        if len(rates) > 1:
            raise ValueError(f"{spec!r}: one EXL3 bitrate per recipe (got {', '.join(f'{r:g}' for r in rates)})")
        if rates:
            kw["exl3_bits"] = rates.pop()
        groups = sorted({f.group for f in parsed if f.group is not None})
        if len(groups) > 1:
            raise ValueError(f"{spec!r}: one int group size per recipe (got {' and '.join(f'g{g}' for g in groups)}): "
                             f"a checkpoint stores all its int linears in groups of one size")
        if groups:
            kw["group"] = groups[0]
        names = [None if f.name == DENSE else f.name for f in parsed]
        experts, other, head = names[0], names[min(1, len(names) - 1)], names[2] if len(names) > 2 else None
        return cls(experts, other, head=head, **kw)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for f in (self.experts, self.other, self.head) if f))

    def format_for(self, key: str, shape: tuple[int, ...]) -> str | None:
        """The format `key` (a stored tensor of `shape`) is stored in under this recipe; None = dense."""
        if len(shape) != 2 or not key.endswith(".weight") or key.startswith("model.visual."):
            return None
        if any(k in key for k in _KEEP_DENSE):
            return None
        if key == LM_HEAD:
            return self._head_format(shape)
        fmt = self.experts if ROUTED_EXPERTS in key else self.other
        if fmt is None or not fits(fmt, (shape[0], shape[1]), self.block_for(fmt), self.virtual, cut_dims(key)):
            return None
        return fmt

    def _head_format(self, shape: tuple[int, ...]) -> str | None:
        """lm_head's format; a HEAD that does not fit raises, as only the recipe's third term asks for it (at the
        release's vocabulary, 154,880 rows, 128-row blocks fit 1 or 2 virtual shards, not 4)."""
        fmt = self.head
        if fmt is None or fits(fmt, (shape[0], shape[1]), self.block_for(fmt), self.virtual, cut_dims(LM_HEAD)):
            return fmt
        rows, cols = tile_shape(fmt, self.block_for(fmt))
        raise ValueError(f"lm_head [{shape[0]}, {shape[1]}] is not whole {fmt} blocks of {rows} x {cols} on each of "
                         f"{self.virtual} virtual shards ({shape[0] // self.virtual} vocabulary rows each): plan for "
                         f"fewer virtual shards (--virtual-shards), take a smaller block, or keep HEAD bf16")

    def block_for(self, fmt: str) -> int | None:
        """The block / group size `fmt`'s codec takes (None: fp8's per-channel scales, else the codec's default)."""
        return (self.group or self.block) if codec_format(fmt)[0] == INT_CODEC else self.block

    def blocks_to_try(self, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """The candidates every int format of the recipe takes as its group (an int3 group must be 32, 64, ...)."""
        def takes(block: int) -> bool:
            try:
                dataclasses.replace(self, block=block)
            except ValueError:
                return False
            return True

        return tuple(b for b in candidates if takes(b))


def tile_shape(fmt: str, block: int | None) -> tuple[int, int]:
    """The [out, in] tile a format stores a linear in (a cut must fall on its grid)."""
    if fmt == "fp8":
        return (block, block) if block else (1, 1)
    if codec_format(fmt)[0] in ("w4a16", INT_CODEC):  # groups along the input dim
        return 1, block or 128
    return EXL3_TILE, EXL3_TILE


def fits(fmt: str, shape: tuple[int, int], block: int | None, virtual: int = 1,
         cut: tuple[int, ...] = (0, 1)) -> bool:
    """Whether an [out, in] weight is whole tiles of `fmt`, and so is each of the `virtual` shards of the dims in
    `cut` (then the loader can cut it at every TP size that divides `virtual`)."""
    tiles = tile_shape(fmt, block)
    if any(n % t for n, t in zip(shape, tiles)):
        return False
    return all(shape[d] % (virtual * tiles[d]) == 0 for d in cut)


def auto_block(recipe: Recipe, tensors: list[tuple[str, tuple[int, ...]]],
               candidates: tuple[int, ...] = BLOCKS) -> int:
    """The fp8 block / w4a16 or int group for a checkpoint of `tensors` ((key, shape) pairs): of the candidates the
    recipe's int formats take (`Recipe.blocks_to_try`), the largest at which every linear the recipe quantizes at the
    smallest one is still quantized, so a larger block never leaves dense a linear that a smaller one would pack. For
    the tiny test model (64 wide, 4 virtual shards) that is 8 (int3: 32, its smallest group); for GLM-5.3-Flash
    128. lm_head takes no part: a HEAD takes the block the rest chose (at the release's dims an fp8 head fits 64-row
    blocks on 4 virtual shards, and would otherwise take every fp8 linear off the 128 x 128 blocks the fast GEMM
    reads)."""
    def packed(block: int) -> set[str]:
        r = dataclasses.replace(recipe, block=block)
        return {k for k, shape in tensors if k != LM_HEAD and r.format_for(k, shape) is not None}

    tried = recipe.blocks_to_try(candidates)
    want = packed(tried[-1])
    return next(b for b in tried if packed(b) >= want)
