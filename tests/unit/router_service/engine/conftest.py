"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest

from common import bf16
from common import linear as L


@pytest.fixture
def panels(monkeypatch):
    """Weights in moe-mesh's panels, as a host where the kernel runs holds them."""
    if bf16.kernel("moe_decode_step") is None:
        pytest.skip("no C compiler or no AVX2 here: no bfloat16 panels")
    monkeypatch.setenv("MOE_MESH_PREPACK", "panels")
    caches = (L.panels, L.packed)  # both read MOE_MESH_PREPACK: none may outlive the test
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()
