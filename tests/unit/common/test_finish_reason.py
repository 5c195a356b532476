"""common/finish_reason.py: every finish reason the APIs name has its own wire value and comes back
from it; "still going" is UNSPECIFIED both ways, and an unknown value reads as still going."""

from __future__ import annotations

import pytest

from common.finish_reason import from_wire, to_wire
from protos.moe_mesh.v1 import types_pb2


@pytest.mark.parametrize(
    ("reason", "wire"),
    [
        ("stop", types_pb2.FINISH_REASON_STOP),
        ("length", types_pb2.FINISH_REASON_LENGTH),
        ("cancelled", types_pb2.FINISH_REASON_CANCELLED),
        (None, types_pb2.FINISH_REASON_UNSPECIFIED),
    ],
)
def test_reasons_and_wire_values_map_both_ways(reason, wire) -> None:
    assert to_wire(reason) == wire and from_wire(wire) == reason


def test_every_finished_wire_value_has_a_name_and_unknown_ones_read_as_unfinished() -> None:
    finished = [v for v in types_pb2.FinishReason.values() if v]
    assert sorted(to_wire(from_wire(v)) for v in finished) == sorted(finished)
    assert from_wire(max(finished) + 1) is None
    with pytest.raises(KeyError):
        to_wire("timeout")
