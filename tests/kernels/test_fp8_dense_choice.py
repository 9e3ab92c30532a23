"""Which fp8 linears run their decode rows on humming (kernels/gpu/fp8_dense.chooses), and the setting that turns it
on: declared once, default triton, reaching serve-rank's settings and the fingerprint the ranks compare."""

from __future__ import annotations

import pytest

from kernels.gpu import fp8_dense
from kernels.gpu.wtiles import Fmt
from services.common import flags
from services.common import shared_flags as shared
from services.launcher.settings import UpSettings
from services.rank_worker.settings import RankSettings

B = (128, 128)


@pytest.mark.parametrize("fmt, block, n, k, setting, want", [
    (Fmt.FP8_BLOCK, B, 24576, 4096, "humming", True),  # KDA q|k|v
    (Fmt.FP8_BLOCK, B, 16384, 1536, "humming", True),  # MLA q_b
    (Fmt.FP8_BLOCK, B, 24576, 4096, "triton", False),  # the default
    (Fmt.FP8_BLOCK, B, 4096, 8192, "humming", False),  # narrow: o_proj
    (Fmt.FP8_BLOCK, B, 16256, 4096, "humming", False),  # below the threshold
    (Fmt.FP8_BLOCK, (64, 64), 24576, 4096, "humming", False),  # another block than humming reads as stored
    (Fmt.FP8_CHANNEL, (1, 1), 24576, 4096, "humming", False),
    (Fmt.INT4, (1, 128), 24576, 4096, "humming", False),
    (Fmt.FP8_BLOCK, B, 24576 + 128, 4096, "humming", True),  # whole scale blocks and 64-column tiles
    (Fmt.FP8_BLOCK, B, 24576, 4096 + 64, "humming", False),  # K cuts a scale block
])
def test_choice(fmt, block, n, k, setting, want):
    assert fp8_dense.chooses(fmt, block, n, k, setting) is want


def test_choice_never_reads_rows():
    """The choice takes the shape and the setting only: no row count reaches it."""
    assert fp8_dense.chooses.__code__.co_varnames[:fp8_dense.chooses.__code__.co_argcount] == \
        ("fmt", "block", "n", "k", "setting")


def test_unknown_setting_refused():
    with pytest.raises(ValueError, match="rest fp8 kernel"):
        fp8_dense.chooses(Fmt.FP8_BLOCK, B, 24576, 4096, "cublas")


def test_flag_choices_are_the_kernel_settings():
    assert shared.REST_FP8_KERNEL.choices == fp8_dense.SETTINGS


def test_setting_reaches_the_rank():
    assert flags.parse(RankSettings, ["--model", "m"], {}).rest_fp8_kernel == "triton"
    env = {"TWINSPARK_REST_FP8_KERNEL": "humming"}
    assert flags.parse(RankSettings, ["--model", "m"], env).rest_fp8_kernel == "humming"
    assert flags.parse(RankSettings, ["--model", "m", "--rest-fp8-kernel", "humming"], {}).rest_fp8_kernel == \
        "humming"
    with pytest.raises(SystemExit):
        flags.parse(RankSettings, ["--model", "m", "--rest-fp8-kernel", "cublas"], {})


def test_up_passes_it_on():
    up = flags.parse(UpSettings, ["--rest-fp8-kernel", "humming"], {})
    assert flags.passed_on(up, RankSettings)["rest_fp8_kernel"] == "humming"


def test_fingerprint_names_it(tmp_path):
    import torch

    from services.rank_worker import fingerprint as fp
    kw = dict(model_dir=tmp_path, world=1, dtype=torch.bfloat16, device="cuda", virtual_shards=4, num_blocks=8,
              block_size=64, num_slots=8, kv_dtype=None)
    assert fp.settings(**kw)["rest fp8 kernel"] == "triton"
    assert fp.fingerprint(fp.settings(**kw)) != fp.fingerprint(fp.settings(**kw, rest_fp8_kernel="humming"))
