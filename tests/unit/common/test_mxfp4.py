"""MXFP4: our dequantizer gives transformers' weights bit for bit; our quantizer (for test
checkpoints) round-trips FP4 values and rounds others to the nearest; products computed from the
codes (the kernels' MXFP4 panels) are the format's meaning to float accuracy, a row's bits its
own whatever its batch-mates."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from common import bf16, mxfp4
from common.errors import CheckpointError
from tests.support.kernels import ROWS, assert_avx2_bits

kernels = pytest.mark.skipif(
    bf16.kernel("moe_linear") is None, reason="no C compiler or no AVX2: no MXFP4 kernels"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_transformers(dtype) -> None:
    codes = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8)  # [experts, rows, blocks, 16]
    scales = torch.randint(127 - 20, 127 + 5, (3, 10, 2), dtype=torch.uint8)
    want = convert_moe_packed_tensors(codes, scales, dtype=dtype)  # [experts, 64, rows]
    assert torch.equal(mxfp4.dequantize(codes, scales, dtype), want.transpose(1, 2))
    assert torch.equal(mxfp4.dequantize(codes[1], scales[1], dtype), want[1].T)  # one expert


def test_quantize_round_trips_fp4_values_and_rounds_others_to_the_nearest() -> None:
    exact = torch.tensor(mxfp4.FP4_VALUES * 4).view(2, 32) * torch.tensor([[2.0**-6], [2.0**3]])
    codes, scales = mxfp4.quantize(exact)
    assert codes.shape == (2, 1, 16) and scales.tolist() == [[127 - 6], [127 + 3]]
    assert torch.equal(mxfp4.dequantize(codes, scales, torch.float32), exact)
    w = torch.randn(4, 96)
    codes, scales = mxfp4.quantize(w)
    # FP4 values are at most 2 apart (4 and 6): the nearest is within one unit of the scale.
    unit = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)
    assert ((mxfp4.dequantize(codes, scales, torch.float32) - w).abs() <= unit).all()


def codes(rows: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code, and scales from 2^-12 to 2^9; row 0's from 2^-127 (E8M0's smallest: subnormal
    in bfloat16 and float32) to 2^-125."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, n // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(127 - 12, 127 + 9, (rows, n // 32), dtype=torch.uint8, generator=gen)
    scales[0] = torch.arange(n // 32) % 3
    return blocks, scales


@kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [96, 256])
def test_a_product_from_the_codes_is_the_formats_meaning_to_float_accuracy(rows, n) -> None:
    blocks, scales = codes(128, n)
    held = mxfp4.panels(blocks, scales, "w_scales")
    assert held.quantization.name == "mxfp4" and held.nbytes == 128 * n // 2 + 128 * n // 32 * 2
    w = mxfp4.dequantize(blocks, scales, torch.float64)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(1)).bfloat16()
    y, ref = held(x).double(), x.double() @ w.T
    # float32 sums (each group's offset by 12 sum(x), then scaled) and one bfloat16 rounding:
    # half an ulp of the result, plus float32's error on sums of terms up to 12 |x| s
    floor = 2**-16 * (
        x.double().abs() @ (12 * torch.exp2(scales.double() - 127)).repeat_interleave(32, 1).T
    )
    assert ((y - ref).abs() <= ref.abs() * 2**-8 + floor).all()
    assert (y[:, 0] != 0).all()  # row 0's tiny scales are not flushed to zero


@kernels
def test_a_rows_bits_from_the_codes_do_not_depend_on_its_batch_mates() -> None:
    held = mxfp4.panels(*codes(128, 256, seed=2), "w_scales")
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole = held(x)  # tiles of 5, 4 and 4 rows; below, the row kernel, the pair, tiles of 3 to 6
    for start, stop in [(0, 1), (1, 3), (3, 6), (6, 13), (0, 12)]:
        assert torch.equal(held(x[start:stop]), whole[start:stop])


@kernels
def test_products_on_avx512_give_the_avx2_kernels_bits() -> None:
    """quant_avx512.c's MXFP4 row kernel and tiles against quant_kernel.c's, a bias and tiny
    scales included."""
    held = mxfp4.panels(*codes(192, 2048, seed=4), "w_scales")
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(m, 2048, generator=gen).bfloat16() for m in ROWS]
    bias = torch.randn(192, generator=gen)
    assert_avx2_bits(lambda: [held(x, b) for x in xs for b in (None, bias)])


def test_rows_not_in_whole_panels_are_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 64, not 96"):
        mxfp4.panels(*codes(96, 64), "w_scales")


def test_a_nan_scale_is_refused_naming_the_tensor() -> None:
    blocks, scales = codes(64, 64)
    scales[3, 1] = 255
    with pytest.raises(CheckpointError, match="NaN in E8M0") as e:
        mxfp4.panels(blocks, scales, "model.layers.0.mlp.experts.down_proj_scales")
    assert "down_proj_scales" in str(e.value)
