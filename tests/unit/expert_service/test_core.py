"""ExpertHost: what one expert service loads."""

from __future__ import annotations

from moe_mesh.common.placement import parse_experts
from moe_mesh.common.weights import FFNWeights
from moe_mesh.expert_service.core import ExpertHost
from tests.support.experts import SPEC


def test_host_loads_only_its_experts(settings) -> None:
    for spec in (SPEC, "2:7; 0:5"):
        host = ExpertHost.load(settings(experts=spec))
        assert sorted(host.weights) == parse_experts(spec, host.spec)
        assert all(isinstance(w, FFNWeights) for w in host.weights.values())
