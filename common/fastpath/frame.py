"""The fast path's frames: what router and expert service exchange over UCX, without UCX.

A frame is up to three messages, in order on one endpoint:

    1. prefix + header   prefix = magic b"MMFP", version u16, kind u16, header length u32
                         (little-endian, PREFIX_BYTES); header = compact JSON, at most
                         MAX_HEADER_BYTES, so a receiver posts one fixed buffer for it
    2. payload           the tensor's bytes, sent from the tensor's own memory (no copy) and
                         received into the output tensor's memory (one buffer)
    3. trailer           b"MMFE" + the payload's byte count as sent (u64)

Messages 2 and 3 exist only when the header announces payload bytes. UCX completes a receive
into a larger buffer without saying how much arrived, so the trailer is what tells a short
payload from a full one.

The version is checked first: a peer speaking another version gets an error frame of code
VERSION (and the endpoint is closed), so a newer router falls back to gRPC cleanly and an older
peer is refused with a message that names both versions.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any

import torch

from moe_mesh.common import errors

MAGIC = b"MMFP"
TRAILER_MAGIC = b"MMFE"
VERSION = 1
_PREFIX = struct.Struct("<4sHHI")  # magic, version, kind, header length
_TRAILER = struct.Struct("<4sQ")  # magic, payload bytes
PREFIX_BYTES = _PREFIX.size  # 12
TRAILER_BYTES = _TRAILER.size  # 12
# Expert ids and token counts of one call fit many times over; the bound lets a receiver post
# one fixed buffer and refuse anything larger before allocating for it.
MAX_HEADER_BYTES = 16 * 1024
FIRST_MESSAGE_BYTES = PREFIX_BYTES + MAX_HEADER_BYTES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class Kind(IntEnum):
    REQUEST = 1
    REPLY = 2
    ERROR = 3


class FrameError(errors.InvalidArgumentError):
    """A frame that cannot be read: the receiver answers with an error frame and closes the endpoint,
    since what follows on it cannot be trusted to line up with frame boundaries."""

    def __init__(self, field: str, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(field, message)
        self.code = code


class VersionError(FrameError):
    """The peer speaks another frame version."""

    def __init__(self, got: int) -> None:
        super().__init__(
            "version",
            f"frame version {got} is not supported; this peer speaks version {VERSION}",
            code="VERSION",
        )


@dataclass(frozen=True)
class RequestHeader:
    """One expert call: who asks (identity fingerprint), what to compute, and the payload's layout."""

    model_id: str
    weights_checksum: str
    layer: int
    expert_ids: list[int]
    token_counts: list[int]
    dtype: str
    shape: list[int]
    payload_bytes: int
    timeout_ms: float | None = None  # the caller's remaining budget; clocks differ between hosts
    trace: dict[str, str] | None = None  # W3C trace context (traceparent...) of a traced call


@dataclass(frozen=True)
class ReplyHeader:
    """The output tensor's layout; its bytes follow as the payload."""

    dtype: str
    shape: list[int]
    payload_bytes: int


@dataclass(frozen=True)
class ErrorHeader:
    """An error answered instead of a tensor; `code` names a gRPC status (or VERSION)."""

    code: str
    message: str
    field: str = ""


Header = RequestHeader | ReplyHeader | ErrorHeader
_KIND = {RequestHeader: Kind.REQUEST, ReplyHeader: Kind.REPLY, ErrorHeader: Kind.ERROR}


def encode_header(header: Header, version: int = VERSION) -> bytes:
    """Message 1 of a frame. `version` is a parameter only so tests can speak an older version."""
    body = json.dumps(asdict(header), separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise FrameError("header", f"{len(body)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    return _PREFIX.pack(MAGIC, version, _KIND[type(header)], len(body)) + body


def encode_trailer(payload_bytes: int) -> bytes:
    return _TRAILER.pack(TRAILER_MAGIC, payload_bytes)


def decode_header(message: memoryview | bytes, max_payload_bytes: int) -> Header:
    """Parse message 1 (the start of a receive buffer of FIRST_MESSAGE_BYTES).

    Raises VersionError for another version and FrameError for anything else malformed: garbage,
    a header over the limit, a payload size that does not match dtype x shape or exceeds
    `max_payload_bytes`."""
    message = memoryview(message)
    if len(message) < PREFIX_BYTES:
        raise FrameError("prefix", f"{len(message)} bytes; a frame starts with {PREFIX_BYTES}")
    magic, version, kind, length = _PREFIX.unpack_from(message)
    if magic != MAGIC:
        raise FrameError(
            "magic", f"expected {MAGIC!r}, got {bytes(magic)!r} (not a fast-path frame)"
        )
    if version != VERSION:
        raise VersionError(version)
    if length > MAX_HEADER_BYTES:
        raise FrameError("header", f"{length} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    if PREFIX_BYTES + length > len(message):
        raise FrameError(
            "header", f"announces {length} bytes, {len(message) - PREFIX_BYTES} arrived"
        )
    try:
        fields = json.loads(bytes(message[PREFIX_BYTES : PREFIX_BYTES + length]))
        cls = {v: k for k, v in _KIND.items()}[Kind(kind)]
        header = cls(**fields)
    except (ValueError, TypeError, KeyError) as e:
        raise FrameError("header", f"cannot be read: {e}") from None
    if isinstance(header, ErrorHeader):
        _expect(header, {"code": str, "message": str, "field": str})
        return header
    _expect(header, {"dtype": str, "shape": list, "payload_bytes": int})
    if isinstance(header, RequestHeader):
        _expect(
            header,
            {
                "model_id": str,
                "weights_checksum": str,
                "layer": int,
                "expert_ids": list,
                "token_counts": list,
            },
        )
        for name in ("expert_ids", "token_counts"):
            if not all(type(v) is int and v >= 0 for v in getattr(header, name)):
                raise FrameError(name, "expected a list of non-negative integers")
        if header.timeout_ms is not None and not isinstance(header.timeout_ms, int | float):
            raise FrameError("timeout_ms", f"expected a number, got {header.timeout_ms!r}")
        if header.trace is not None and not (
            isinstance(header.trace, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in header.trace.items())
        ):
            raise FrameError("trace", "expected a map of strings (W3C trace context)")
    _check_payload(header, max_payload_bytes)
    return header


def decode_trailer(message: bytes | memoryview, payload_bytes: int) -> None:
    """Raises FrameError unless the trailer confirms `payload_bytes` arrived."""
    if len(message) < TRAILER_BYTES:
        raise FrameError("trailer", f"{len(message)} bytes; expected {TRAILER_BYTES}")
    magic, sent = _TRAILER.unpack_from(message)
    if magic != TRAILER_MAGIC:
        raise FrameError("trailer", f"expected {TRAILER_MAGIC!r}, got {bytes(magic)!r}")
    if sent != payload_bytes:
        raise FrameError(
            "payload", f"short payload: header announces {payload_bytes} bytes, {sent} were sent"
        )


def _expect(header: Header, types: dict[str, type]) -> None:
    for name, typ in types.items():
        value = getattr(header, name)
        # bool is an int in Python, never a valid count or id here.
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise FrameError(name, f"expected {typ.__name__}, got {value!r}")


def _check_payload(header: RequestHeader | ReplyHeader, max_payload_bytes: int) -> None:
    if header.dtype not in DTYPES:
        raise FrameError(
            "dtype", f"unsupported dtype {header.dtype!r}; expected one of {', '.join(DTYPES)}"
        )
    if not all(type(d) is int and d >= 0 for d in header.shape):
        raise FrameError("shape", f"expected non-negative integer dimensions, got {header.shape}")
    numel = 1
    for d in header.shape:
        numel *= d
    expected = numel * DTYPES[header.dtype].itemsize
    if header.payload_bytes != expected:
        raise FrameError(
            "payload_bytes",
            f"{header.payload_bytes} bytes announced; shape {header.shape} of {header.dtype} "
            f"needs {expected}",
        )
    if expected > max_payload_bytes:
        raise FrameError(
            "payload_bytes",
            f"{expected} bytes exceeds the size limit of {max_payload_bytes} (max_message_bytes)",
            code="RESOURCE_EXHAUSTED",
        )


def empty_like_payload(header: RequestHeader | ReplyHeader) -> torch.Tensor:
    """The one buffer a payload is received into: the tensor it becomes."""
    return torch.empty(header.shape, dtype=DTYPES[header.dtype])


def payload_view(t: torch.Tensor) -> Any:
    """A byte view of a contiguous tensor's own memory (numpy has no bfloat16, so bytes)."""
    return t.reshape(-1).view(torch.uint8).numpy()


# -- errors across the fast path: the same classes as over gRPC ----------------------------------

# Mirrors common/status.py (tests check they agree); names are gRPC status names so both paths
# speak one vocabulary, without importing grpc here.
_TO_CODE: list[tuple[type[errors.MoeMeshError], str]] = [
    (errors.InvalidArgumentError, "INVALID_ARGUMENT"),
    (errors.AlreadyExistsError, "ALREADY_EXISTS"),
    (errors.NotFoundError, "NOT_FOUND"),
    (errors.PreconditionError, "FAILED_PRECONDITION"),
    (errors.ResourceExhaustedError, "RESOURCE_EXHAUSTED"),
    (errors.UnavailableError, "UNAVAILABLE"),
    (errors.DeadlineExceededError, "DEADLINE_EXCEEDED"),
    (errors.CheckpointError, "FAILED_PRECONDITION"),
]
# As over gRPC (common.status.error_from_rpc): INVALID_ARGUMENT from a service means the router
# sent a malformed request, a bug rather than bad input, hence the base class.
_FROM_CODE: dict[str, type[errors.MoeMeshError]] = {
    "INVALID_ARGUMENT": errors.MoeMeshError,
    "NOT_FOUND": errors.NotFoundError,
    "FAILED_PRECONDITION": errors.PreconditionError,
    "UNAVAILABLE": errors.UnavailableError,
    "DEADLINE_EXCEEDED": errors.DeadlineExceededError,
}


def error_header(error: errors.MoeMeshError) -> ErrorHeader:
    code = getattr(error, "code", None) or next(
        (c for cls, c in _TO_CODE if isinstance(error, cls)), "INTERNAL"
    )
    return ErrorHeader(code=code, message=str(error), field=getattr(error, "field", "") or "")


def error_from_header(header: ErrorHeader, peer: str) -> errors.MoeMeshError:
    """The exception a gRPC caller would get for the same status; unlisted codes count as unavailable."""
    cls = _FROM_CODE.get(header.code, errors.UnavailableError)
    return cls(f"{peer}: {header.code}: {header.message}")
