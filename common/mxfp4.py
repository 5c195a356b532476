"""MXFP4 (OCP Microscaling, FP4 E2M1 values), the format published gpt-oss checkpoints store experts in.

A row of n weights is n / 32 blocks of 32 four-bit codes that share one power-of-two scale:

    *_blocks [..., n / 32, 16] uint8   two codes per byte, the low nibble first
    *_scales [..., n / 32]     uint8   the block's exponent + 127 (E8M0)
    weight = FP4_VALUES[code] * 2 ** (scale - 127)

as transformers' integrations/mxfp4.py (`convert_moe_packed_tensors`) reads them.

Served in bfloat16 on a CPU with the C kernels, experts are computed from that form (`pack`):
the codes rearranged into the kernels' panels of 32 output rows, half a byte a weight, and each
scale a bfloat16 power of two (common/quant_kernel.c). Otherwise (float32, a GPU, no kernels) an
expert is dequantized at load (`dequantize`): FP4 values times a power of two are exact in
bfloat16 and float32, so the weights are bit-identical to transformers' dequantized ones.
"""

from __future__ import annotations

import torch

from common import bf16
from common.errors import CheckpointError
from common.quant import Quantization, QuantPanels

BLOCK = 32  # weights per scale
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; codes 8-15 are their negatives
FP4_VALUES = MAGNITUDES + tuple(-m for m in MAGNITUDES)
FORMAT = Quantization("mxfp4", BLOCK)
# Code c as the kernel reads it: the rank of its value, so that code 0 means -6 and the kernel's
# table (2 v + 12 by rank) starts at 0 (common/quant_kernel.c)
_RANKS = torch.tensor([8 + c for c in range(8)] + [15 - c for c in range(8, 16)], dtype=torch.uint8)
NAN_SCALE = 255  # E8M0's NaN


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


def computable(dtype: torch.dtype | None, rows: int) -> bool:
    """Whether an expert weight of `rows` output rows, served in `dtype`, is computed from its
    codes here (`panels`) rather than dequantized."""
    return (
        dtype == torch.bfloat16
        and rows % bf16.COLUMNS == 0
        and bf16.kernel("moe_linear") is not None
    )


def pack(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    tensor: str,
    data: torch.Tensor,
    packed_scales: torch.Tensor,
) -> None:
    """Codes [rows, n / 32, 16] and scales [rows, n / 32] (rows a multiple of bf16.COLUMNS) into
    the kernels' MXFP4 panels (`data`, `packed_scales`: flat, of FORMAT.layout's sizes): codes
    re-ranked and laid out as int4's words (input 8i + j of a column at bits 4j), scales as
    bfloat16 2^(e - 128). A NaN scale is refused, naming `tensor`."""
    rows, groups, _ = blocks.shape
    if rows % bf16.COLUMNS:
        raise ValueError(f"MXFP4 panels hold rows in multiples of {bf16.COLUMNS}, not {rows}")
    if bool((scales == NAN_SCALE).any()):
        raise CheckpointError(f"a scale of {NAN_SCALE} (NaN in E8M0)", tensor=tensor)
    n = groups * BLOCK
    codes = _RANKS[torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()].view(rows, n)
    panels = rows // bf16.PANEL
    words = codes.view(panels, bf16.PANEL, n // 8, 4, 2)  # a word's bytes, low nibble first
    data.copy_((words[..., 0] | (words[..., 1] << 4)).transpose(1, 2).reshape(-1))
    half = torch.ldexp(torch.ones(()), scales.float() - 128).to(torch.bfloat16)
    packed_scales.copy_(half.view(panels, bf16.PANEL, groups).transpose(1, 2).reshape(-1))


def panels(blocks: torch.Tensor, scales: torch.Tensor, tensor: str) -> QuantPanels:
    """`pack`'s panels in this process's memory."""
    shape = (blocks.shape[0], blocks.shape[1] * BLOCK)
    data, packed_scales = (torch.empty(n, dtype=t) for n, t in FORMAT.layout(shape).values())
    pack(blocks, scales, tensor, data, packed_scales)
    return QuantPanels.of(data, packed_scales, shape, FORMAT)
