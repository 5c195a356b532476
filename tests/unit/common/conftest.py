"""Fixtures of the common/ unit tests."""

from __future__ import annotations

import pytest

from common import bf16

ISAS = {1: "avx2", 2: "avx512"}


@pytest.fixture(params=[n for n in ISAS if n <= bf16.level()], ids=lambda n: ISAS[n])
def isa(request):
    """The vector kernels of one instruction set this CPU runs (an AVX-512 host runs both)."""
    bf16.library().moe_bf16_limit(request.param)
    try:
        yield request.param
    finally:
        bf16.library().moe_bf16_limit(3)  # the highest: every kernel this CPU runs
