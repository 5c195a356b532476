"""MXFP4: our dequantizer gives transformers' weights bit for bit; our quantizer (for test
checkpoints) round-trips FP4 values and rounds others to the nearest."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from common import mxfp4


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
