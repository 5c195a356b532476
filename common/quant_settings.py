"""The `--quantize` flags of every service that holds routed experts, torch-free: a command checks
its flags before it imports torch (common/quant.py computes with them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field
from pydantic_settings import BaseSettings

if TYPE_CHECKING:
    from common.quant import Quantization


class QuantizationSettings(BaseSettings):
    """The fields of the settings of every service that holds routed experts."""

    quantize: Literal["none", "int8", "int4"] = Field(
        "none",
        description="routed experts' weights: 'int8' (per output channel) or 'int4' (groups of "
        "--quantize-group-size inputs), computed with bfloat16 activations (needs dtype "
        "bfloat16); 'none' keeps the compute dtype",
    )
    quantize_group_size: Literal[32, 64, 128] = Field(
        64, description="inputs per int4 scale (with --quantize int4)"
    )

    @property
    def quantization(self) -> Quantization | None:
        from common.quant import Quantization

        return Quantization.parse(self.quantize, self.quantize_group_size)
