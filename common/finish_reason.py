"""Why a generation ended, as the APIs name it ("stop", "length", "cancelled") and as the wire enum
(types.proto FinishReason): one table for every service and client."""

from __future__ import annotations

from protos.moe_mesh.v1 import types_pb2

TO_WIRE = {
    "stop": types_pb2.FINISH_REASON_STOP,
    "length": types_pb2.FINISH_REASON_LENGTH,
    "cancelled": types_pb2.FINISH_REASON_CANCELLED,
}
FROM_WIRE = {wire: name for name, wire in TO_WIRE.items()}


def to_wire(reason: str | None) -> int:
    """The enum value of a finish reason; UNSPECIFIED (0) while generation goes on."""
    return TO_WIRE[reason] if reason is not None else types_pb2.FINISH_REASON_UNSPECIFIED


def from_wire(value: int) -> str | None:
    """The finish reason of an enum value; None for UNSPECIFIED (not finished) and unknown values."""
    return FROM_WIRE.get(value)
