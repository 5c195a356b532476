"""Weight-only int8 and int4 experts: quantized once per host, computed by the bfloat16 kernels.

Activations stay bfloat16 (float32 inside the kernel); only the weights are integers, each
output column's products summed in float32 (common/quant_kernel.c), int4's (and int8's on a CPU
with AVX-512 VNNI and VBMI) in integers from each group's inputs made exact integers
(common/int_dot.c):

- int8, per output channel, symmetric: s = max|w| / 127 (float32), q = round(w / s) in
  [-127, 127]. One byte a weight.
- int4, per group of `group_size` inputs (32, 64 or 128) of an output channel, symmetric as
  GGUF's q4_0: the group's weight of largest magnitude m gives s = -m / 8 (rounded to bfloat16,
  the scale stored), q = round(w / s) clamped to [-8, 7]. Half a byte a weight, plus 2 bytes of
  scale a group: 4.25 bits at group 64.

The reference arithmetic is `dequantize` (s * q in float64); a product equals it times x to
float32 accuracy before its bfloat16 rounding. Zero points (asymmetric int4) are not offered:
symmetric groups keep the kernel's inner loop free of them, and the accuracy figures in
docs/performance.md are for these formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from common import bf16
from common.errors import CheckpointError

SCHEMES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)
# bf16_kernel.c's FORMAT_INT8, FORMAT_INT4, FORMAT_FP8, FORMAT_MXFP4 (FP8 and MXFP4 checkpoints as
# published: common/fp8.py, common/mxfp4.py)
_FORMATS = {"int8": 1, "int4": 2, "fp8": 3, "mxfp4": 4}
# What `pack` writes: a packed-weight cache file built for another layout is stale.
# (MXFP4's, common/mxfp4.py, came later under entry names of its own: unchanged here so that the
# other formats' files stay valid; a change to it changes this string.)
LAYOUT = (
    "int8 and fp8 panels of 32 columns; int4 words of 8 nibbles in panels of 32, bfloat16 "
    "scales; v1"
)


@dataclass(frozen=True)
class Quantization:
    """How experts are held: `scheme` int8 or int4, int4 in groups of `group_size` inputs; or
    fp8, an FP8 checkpoint's blocks of `group_size` inputs (common/fp8.py); or mxfp4, an MXFP4
    checkpoint's codes in blocks of 32 (common/mxfp4.py)."""

    scheme: Literal["int8", "int4", "fp8", "mxfp4"]
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.scheme not in _FORMATS:
            raise ValueError(f"quantize: {self.scheme!r} is not one of {SCHEMES}")
        if self.scheme == "mxfp4":
            if self.group_size != 32:
                raise ValueError(f"MXFP4 blocks of {self.group_size} inputs: they hold 32")
        elif self.scheme == "fp8":
            if self.group_size % 32:
                raise ValueError(f"FP8 blocks of {self.group_size} inputs: not a multiple of 32")
        elif self.group_size not in GROUP_SIZES:
            raise ValueError(f"quantize_group_size: {self.group_size} is not one of {GROUP_SIZES}")

    @classmethod
    def parse(cls, scheme: str, group_size: int = 64) -> Quantization | None:
        """From settings' `quantize` and `quantize_group_size`: None for 'none'."""
        return None if scheme == "none" else cls(scheme, group_size)  # type: ignore[arg-type]

    @property
    def name(self) -> str:
        """'int8', 'int4-g64', 'fp8' or 'mxfp4': what status, placement and metrics call the
        precision."""
        return f"int4-g{self.group_size}" if self.scheme == "int4" else self.scheme

    @property
    def format(self) -> int:
        return _FORMATS[self.scheme]

    @property
    def group(self) -> int:
        """Inputs a scale covers in the kernel's terms (0: the whole row)."""
        return 0 if self.scheme == "int8" else self.group_size

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of `shape` [out, in] can be held so (`check` says why not)."""
        out, k = shape
        return out % bf16.COLUMNS == 0 and (self.scheme == "int8" or k % self.group_size == 0)

    def check(self, shape: tuple[int, int], tensor: str) -> None:
        """CheckpointError naming `tensor` where a weight of `shape` [out, in] cannot be held so."""
        out, k = shape
        if out % bf16.COLUMNS:
            raise CheckpointError(
                f"{self.name} weights need output rows in multiples of {bf16.COLUMNS}, "
                f"this one has {out}",
                tensor=tensor,
            )
        if self.scheme != "int8" and k % self.group_size:
            raise CheckpointError(
                f"quantize_group_size {self.group_size} does not divide the input dimension {k}",
                tensor=tensor,
            )

    def layout(self, shape: tuple[int, int]) -> dict[str, tuple[int, torch.dtype]]:
        """What `pack` writes for a weight of `shape`: elements and dtype of its data and scales."""
        out, k = shape
        if self.scheme == "int8":
            return {"data": (out * k, torch.uint8), "scales": (out, torch.float32)}
        if self.scheme == "fp8":  # a scale per panel of 32 rows and block of inputs
            blocks = out // bf16.PANEL * (k // self.group_size)
            return {"data": (out * k, torch.uint8), "scales": (blocks, torch.float32)}
        return {  # int4 and MXFP4: half a byte a weight, a scale per column and group
            "data": (out * k // 2, torch.uint8),
            "scales": (out * k // self.group_size, torch.bfloat16),
        }


def precision(dtype: torch.dtype, q: Quantization | None) -> str:
    """What experts are held in, as status and placement name it: 'int4-g64', or 'bfloat16'."""
    return q.name if q is not None else str(dtype).removeprefix("torch.")


def quantize(weight: torch.Tensor, q: Quantization) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 [out, in], scales): float32 [out] for int8, bfloat16 [out, in / group] for int4."""
    w = weight.float()
    if q.scheme == "int8":
        scales = w.abs().amax(dim=1) / 127
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        values = torch.round(w / safe[:, None]).clamp_(-127, 127)
        return values.to(torch.int8), scales
    out, k = w.shape
    groups = w.view(out, k // q.group_size, q.group_size)
    extreme = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    scales = (extreme / -8).to(torch.bfloat16)
    safe = torch.where(scales != 0, scales.float(), torch.ones_like(extreme))
    values = torch.round(groups / safe[..., None]).clamp_(-8, 7).view(out, k)
    return values.to(torch.int8), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, q: Quantization) -> torch.Tensor:
    """The format's reference weight [out, in]: scale times value, in float64 (`unpack`'s)."""
    v = values.double()
    if q.scheme == "int8":
        return v * scales.double()[:, None]
    out, k = v.shape
    grouped = v.view(out, k // q.group_size, q.group_size) * scales.double()[..., None]
    return grouped.view(out, k)


def pack(weight: torch.Tensor, q: Quantization, data: torch.Tensor, scales: torch.Tensor) -> None:
    """`weight` [rows, in] (rows a multiple of bf16.PANEL) quantized as `quantize` does, in C,
    into the kernel's layout in `data` and `scales` (flat, of q.layout's sizes). Panels are
    independent: a weight's row blocks packed into consecutive parts of `data` and `scales` are
    that weight packed."""
    if q.scheme not in ("int8", "int4"):  # checkpoints' own formats: fp8.pack, mxfp4.pack
        raise ValueError(f"{q.name} weights are packed as published, not quantized here")
    rows, k = weight.shape
    sizes = q.layout((rows, k))
    assert rows % bf16.PANEL == 0 and k % 8 == 0
    assert (data.numel(), data.dtype) == sizes["data"] and (scales.numel(), scales.dtype) == sizes[
        "scales"
    ]
    assert data.is_contiguous() and scales.is_contiguous()
    w = weight if weight.dtype in (torch.bfloat16, torch.float32) else weight.float()
    w = w.contiguous()  # held here while the kernel reads it
    bf16.library().moe_quantize(
        q.format,
        q.group_size,
        w.data_ptr(),
        w.dtype == torch.bfloat16,
        rows,
        k,
        data.data_ptr(),
        scales.data_ptr(),
        torch.get_num_threads(),
    )


def unpack(
    data: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], q: Quantization
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s output read back as `quantize` returns it: (values [out, in], scales); FP8's
    values are e4m3, its scales one per row and block of inputs."""
    out, k = shape
    panels = out // bf16.PANEL
    if q.scheme == "mxfp4":
        raise ValueError("MXFP4 panels hold re-ranked codes: common/mxfp4.py reads the format")
    if q.scheme != "int4":  # [panel][k][32] bytes
        kind = torch.int8 if q.scheme == "int8" else torch.float8_e4m3fn
        values = data.view(kind).view(panels, k, bf16.PANEL).transpose(1, 2).reshape(out, k)
        if q.scheme == "int8":
            return values, scales.clone()
        return values, scales.view(panels, -1).repeat_interleave(bf16.PANEL, dim=0)
    words = data.view(torch.int32).view(panels, k // 8, bf16.PANEL)  # nibble j: input 8i + j
    nibbles = torch.stack([(words >> (4 * j)) & 15 for j in range(8)], dim=-1) - 8
    values = nibbles.permute(0, 2, 1, 3).reshape(out, k).to(torch.int8)
    return values, scales.view(panels, -1, bf16.PANEL).transpose(1, 2).reshape(out, -1)


class QuantPanels(bf16.Panels):
    """An int8 or int4 weight [out, in] in the kernel's layout; `panels(x, bias)` computes
    F.linear of bfloat16 x by the dequantized weight (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, q: Quantization) -> None:
        q.check(tuple(weight.shape), "weight")
        sizes = q.layout(tuple(weight.shape))
        data, scales = (torch.empty(n, dtype=dtype) for n, dtype in sizes.values())
        pack(weight, q, data, scales)
        self._hold(weight.shape, data, scales, q)

    @classmethod
    def of(  # type: ignore[override]
        cls, data: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], q: Quantization
    ) -> QuantPanels:
        """QuantPanels over `data` and `scales` as `pack` wrote them (mapped from a
        common.packcache file), used as they are."""
        sizes = q.layout(shape)
        for name, t in (("data", data), ("scales", scales)):
            if (t.numel(), t.dtype) != sizes[name] or t.dim() != 1:
                raise ValueError(
                    f"{name} {t.dtype} {list(t.shape)} is not a {list(shape)} {q.name} weight's"
                )
        panels = cls.__new__(cls)
        panels._hold(shape, data, scales, q)
        return panels

    def _hold(
        self, shape: tuple[int, ...], data: torch.Tensor, scales: torch.Tensor, q: Quantization
    ) -> None:
        self.shape, self.data, self.scales, self.quantization = torch.Size(shape), data, scales, q
        self.format, self.group = q.format, q.group
