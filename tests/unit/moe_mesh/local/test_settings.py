"""moe_mesh/local/settings.py: `up`'s defaults."""

from __future__ import annotations

from common.telemetry import DEFAULT_SAMPLE_RATIO
from moe_mesh.local.settings import TRACE_SAMPLE, UpSettings


def test_up_traces_the_services_default_share_unless_told() -> None:
    assert TRACE_SAMPLE == DEFAULT_SAMPLE_RATIO == UpSettings().trace_sample
    assert UpSettings(trace_sample=0).trace_sample == 0  # no span files at all
