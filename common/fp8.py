"""FP8 checkpoints as published (DeepSeek-V3, R1, V3.1; Qwen3's FP8 releases): read as they are.

Each quantized linear weight `W.weight` is float8_e4m3fn [out, in] with `W.weight_scale_inv`,
float32 [ceil(out / br), ceil(in / bk)] for quantization_config.weight_block_size [br, bk]: the
weight is e4m3 value times its block's scale. Routed experts are computed from that form (a
quantized format of the kernels, common/quant.py's "fp8": the bytes rearranged into panels, a
scale per panel of 32 rows and block of inputs), one byte a weight; everything else that is FP8
(attention, shared and dense MLPs) is dequantized block by block at load into the compute dtype.
"""

from __future__ import annotations

import torch

from common import bf16
from common.errors import CheckpointError

FP8 = torch.float8_e4m3fn
ROWS_PER_STEP = 1024  # rows dequantized at a time: a float32 temporary of a few MiB


def scale_name(weight: str) -> str:
    """`model.layers.0.mlp.down_proj.weight` -> its `...down_proj.weight_scale_inv`."""
    return weight + "_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The weight_scale_inv a weight of `shape` [out, in] has in blocks of `block`."""
    (out, k), (br, bk) = shape, block
    return -(-out // br), -(-k // bk)


def dequantize(
    weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """An e4m3 weight [out, in] times its block scales, in `dtype` (each product computed in
    float32, then rounded once), ROWS_PER_STEP rows at a time."""
    out, k = weight.shape
    br, bk = block
    y = torch.empty(out, k, dtype=dtype)
    for start in range(0, out, ROWS_PER_STEP):
        rows = weight[start : start + ROWS_PER_STEP].float()
        s = scales[start // br : -(-(start + rows.shape[0]) // br)]
        s = s.repeat_interleave(br, dim=0)[: rows.shape[0]].repeat_interleave(bk, dim=1)[:, :k]
        y[start : start + rows.shape[0]] = rows * s
    return y


def pack(
    weight: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int],
    first_row: int,
    data: torch.Tensor,
    packed_scales: torch.Tensor,
) -> None:
    """Rows [first_row, first_row + len(weight)) of an e4m3 weight (whole panels) into the
    kernels' FP8 panels: the bytes as int8 panels hold theirs, and for each panel and block of
    inputs the scale of the block its rows lie in (rows of a panel never straddle two: br is a
    multiple of 32)."""
    rows, k = weight.shape
    br, bk = block
    panels = rows // bf16.PANEL
    raw = weight.view(torch.uint8).view(panels, bf16.PANEL, k).transpose(1, 2)
    data.copy_(raw.reshape(-1))
    row_blocks = (first_row + bf16.PANEL * torch.arange(panels)) // br
    packed_scales.copy_(scales[row_blocks, : k // bk].reshape(-1))


def check_scales(
    scales: torch.Tensor, shape: tuple[int, int], block: tuple[int, int], name: str
) -> None:
    """CheckpointError naming the scale tensor when it does not fit the weight."""
    want = scale_shape(shape, block)
    if tuple(scales.shape) != want or scales.dtype != torch.float32:
        raise CheckpointError(
            f"{scales.dtype} {list(scales.shape)}, expected float32 {list(want)} for a "
            f"{list(shape)} weight in blocks of {list(block)} (quantization_config.weight_block_size)",
            tensor=scale_name(name),
        )
