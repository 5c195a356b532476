"""`moe-mesh status` (ops/client.py) on a router whose placement lost a whole expert group."""

from __future__ import annotations

from moe_mesh.ops.client import unserved


def router(placement: dict[str, str], moe_layers=(0, 1, 2)) -> dict:
    return {
        "num_layers": 3,
        "num_experts": 4,
        "moe_layers": list(moe_layers),
        "placement": placement,
    }


def test_experts_no_replica_serves_are_named_as_a_spec() -> None:
    assert unserved(router({"a:1": "*:0-1", "b:1": "*:2-3"})) == ""
    assert unserved(router({"a:1": "*:0-1"})) == "0-2:2-3"
    assert unserved(router({"colocated": "0:0-3", "a:1": "1-2:0-3"})) == ""
    # Dense layers have no experts to lose.
    assert unserved(router({"a:1": "0,2:0-3"}, moe_layers=(0, 2))) == ""
    assert unserved(router({})) == "0-2:0-3"
