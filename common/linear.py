"""Linear layers in the layout this CPU's GEMM kernels read fastest.

Decoding reads every weight once per step, so a step's time is mostly GEMV/small-GEMM time, and
torch's default CPU path (MKL on an unpacked [out, in] matrix) reaches under half of this
machine's memory bandwidth. oneDNN's prepacked weights (what torch's own inductor uses for
frozen CPU models) run the same products 2-4× faster in float32 and about 1.5× faster in
bfloat16 at 1-32 rows (avx512_bf16/AMX kernels). `prepack` converts a weight once at load;
`linear` takes either form, so code and tests that hold plain tensors keep working.

MOE_MESH_PREPACK=off keeps every weight a plain tensor (for comparison, or where oneDNN
misbehaves).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.cache
def _packable_dtypes() -> frozenset[torch.dtype]:
    if os.environ.get("MOE_MESH_PREPACK", "on").lower() in ("off", "0", "false", "no"):
        return frozenset()
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return frozenset()
    dtypes = {torch.float32}
    # Without native bf16 instructions oneDNN emulates them, slower than torch's own path.
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    return frozenset(dtypes)


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout when that is faster here, else unchanged."""
    if weight.device.type != "cpu" or weight.dtype not in _packable_dtypes() or weight.is_mkldnn:
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] · weightᵀ (+ bias) -> [n, out], for a plain or a prepacked weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
