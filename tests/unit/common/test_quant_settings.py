"""The --quantize settings: validated like every flag, and turned into the format they name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.quant import Quantization
from common.quant_settings import QuantizationSettings


def test_the_settings_name_the_format_or_none() -> None:
    assert QuantizationSettings().quantization is None
    assert QuantizationSettings(quantize="int8").quantization == Quantization("int8")
    q = QuantizationSettings(quantize="int4", quantize_group_size=32).quantization
    assert q == Quantization("int4", 32) and q.name == "int4-g32"
    for bad in ({"quantize": "int3"}, {"quantize_group_size": 48}):
        with pytest.raises(ValidationError):
            QuantizationSettings(**bad)
