"""moe_mesh/ops/coverage.py: the pairs an expert spec names in a router's model, and the experts its
placement lost (what `moe-mesh status` flags)."""

from __future__ import annotations

from moe_mesh.ops.coverage import COLOCATED, pairs_of, unserved

SHAPE = {"num_layers": 3, "num_experts": 8, "moe_layers": [1, 2]}  # layer 0 is dense


def test_pairs_of_parses_a_spec_in_the_records_model() -> None:
    assert pairs_of("", SHAPE) == set()
    assert pairs_of("  ", SHAPE) == set()
    assert pairs_of("1:0-1; 2:7", SHAPE) == {(1, 0), (1, 1), (2, 7)}
    assert pairs_of("*:3", SHAPE) == {(1, 3), (2, 3)}


def test_experts_no_replica_serves_are_named_as_a_spec() -> None:
    def lost(placement: dict[str, str]) -> str:
        return unserved(SHAPE | {"placement": placement})

    assert lost({"a:1": "*:0-3", "b:1": "*:4-7"}) == ""
    assert lost({"a:1": "*:0-3"}) == "1-2:4-7"  # layer 0 is dense: nothing to lose there
    assert lost({COLOCATED: "1:0-7", "a:1": "2:0-7"}) == ""
    assert lost({}) == "1-2:0-7"


def test_a_placement_this_client_cannot_read_claims_nothing() -> None:
    assert unserved(SHAPE | {"placement": {"a:1": "9:0"}}) == ""  # layer 9 is not in the model
