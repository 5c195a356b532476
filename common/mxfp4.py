"""MXFP4 (OCP Microscaling, FP4 E2M1 values), the format published gpt-oss checkpoints store experts in.

A row of n weights is n / 32 blocks of 32 four-bit codes that share one power-of-two scale:

    *_blocks [..., n / 32, 16] uint8   two codes per byte, the low nibble first
    *_scales [..., n / 32]     uint8   the block's exponent + 127 (E8M0)
    weight = FP4_VALUES[code] * 2 ** (scale - 127)

as transformers' integrations/mxfp4.py (`convert_moe_packed_tensors`) reads them. We dequantize
one expert at a time at load: FP4 values times a power of two are exact in bfloat16 and float32,
so the weights are bit-identical to transformers' dequantized ones.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per scale
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; codes 8-15 are their negatives
FP4_VALUES = MAGNITUDES + tuple(-m for m in MAGNITUDES)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes [..., n / 32, 16] uint8 and scales [..., n / 32] uint8 -> weights [..., n] in dtype."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(*blocks.shape[:-1], BLOCK, dtype=dtype)  # [..., n / 32, 32]
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    torch.ldexp(out, scales.int()[..., None] - 127, out=out)
    return out.flatten(-2)


def quantize(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., n] (n a multiple of 32) -> (codes [..., n / 32, 16], scales [..., n / 32]).

    Each block gets the smallest scale at which its largest magnitude fits under 6 (FP4's
    largest value), and each weight the nearest FP4 value. For test checkpoints in the published
    layout; serving only dequantizes."""
    w = weights.float().unflatten(-1, (-1, BLOCK))  # [..., n / 32, 32]
    amax = w.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
    magnitudes = torch.tensor(MAGNITUDES)
    scaled = (w / torch.exp2(exponent)).clamp(-6, 6)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [..., n / 32, 32]
    codes = (codes + 8 * (scaled < 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent[..., 0] + 127).to(torch.uint8)
