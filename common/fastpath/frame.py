"""The fast path's frames: what router and expert service exchange over UCX, without UCX.

Messages are UCX tag messages; a receiver probes a tag, learns the message's exact length, and
receives it into a buffer of that size (one buffer, no size guess, no trailer). A frame is one or
two messages on one tag, in order:

    1. prefix + header   prefix = magic b"MMFP", version u16, kind u8, flags u8, header length
                         u32 (little-endian, PREFIX_BYTES); header = the kind's fixed fields, then
                         its lists and strings (layouts below), at most MAX_HEADER_BYTES. With
                         flag INLINE, the payload follows in the same message at the next
                         PAYLOAD_ALIGN boundary, and the message must end exactly where the
                         payload does.
    2. payload           without INLINE: the tensor's bytes, sent from the tensor's own memory
                         (no copy) and received into the output tensor's memory; only when the
                         header announces payload bytes, and its length must match them exactly

Headers are packed structs, not JSON: on this host JSON took ~90 us of each call's ~0.45 ms of
CPU at each end (encode 17-41 us, decode 38-48 us with its type checks), and a fixed layout
needs no type checks (a count cannot be a string). Little-endian throughout:

    request  layer u32, call u32, timeout_ms f64 (NaN: none), payload_bytes u64, expert ids u16,
             token counts u16, dims u8, dtype u8 (DTYPE_CODES), then byte lengths u16 of model id,
             weights checksum and trace; then expert ids u32 each, token counts u32 each, shape
             u64 each, model id and checksum (UTF-8), trace (a JSON object of strings, or empty)
    reply    payload_bytes u64, service_s f64, dtype u8, dims u8; then shape u64 each
    error    byte lengths u16 of code and field, u32 of message; then the three (UTF-8)

Payloads up to INLINE_MAX_BYTES go inline: every message to a sleeping peer costs a wake-up (a
signal, a context switch, a loop iteration: ~50-100 us on 2 cores), far more than copying a
small payload; the receiver's tensor is a view of the received message (no copy there).

Tags (64 bits): a client says hello on hello_tag(server) with its own worker address, a random
client id and, under mutual TLS, a proof that it holds a mesh certificate (fastpath.auth); then it
sends requests on request_tag(id) and each call's reply comes back on reply_tag(id, call). A frame
the service cannot read is refused on control_tag(id) (its call may be unreadable), and the service
forgets the client: what follows cannot be trusted.

The version is checked first: a peer speaking another version gets an error frame of code
VERSION, so a newer router falls back to gRPC cleanly and an older peer is refused with a message
that names both versions. Version 1 was the listener protocol (header, payload, trailer); version 2 had no INLINE flag;
version 3 replies did not say how long the service took; version 4 headers were JSON.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from common import errors

MAGIC = b"MMFP"
HELLO_MAGIC = b"MMFH"
VERSION = 5
_PREFIX = struct.Struct("<4sHBBI")  # magic, version, kind, flags, header length
INLINE = 1  # flags: the payload is in message 1, after the header
PAYLOAD_ALIGN = 64  # an inline payload starts here, so its tensor view is aligned for any dtype
# Measured crossover (bench.fastpath_echo): a copy of up to this many bytes costs less than the
# wake-up of a second message.
INLINE_MAX_BYTES = 256 * 1024
# magic, version, proof length, client id, CRC-32 of the worker address; then address and proof
_HELLO = struct.Struct("<4sHHQI")
PREFIX_BYTES = _PREFIX.size  # 12
# Expert ids and token counts of one call fit many times over; the bound lets a receiver post
# one fixed buffer and refuse anything larger before allocating for it.
MAX_HEADER_BYTES = 16 * 1024
FIRST_MESSAGE_BYTES = PREFIX_BYTES + MAX_HEADER_BYTES + PAYLOAD_ALIGN  # + an inline payload
# Worker addresses are a few hundred bytes, proofs (a certificate and a signature) about one KiB.
MAX_HELLO_BYTES = _HELLO.size + 16384
# Bit 63 set: client tags are below 2**63 (31-bit ids), so a hello never matches one.
HELLO_TAG = (1 << 63) | 0x4D4D_4650_4845_0000  # b"MMFPHE" + the server's number


def hello_tag(server: int) -> int:
    """Where the server numbered `server` (1..0xFFFF) on a worker takes hellos."""
    return HELLO_TAG | server


CLIENT_ID_BITS = 31  # request and reply tags are (id << 32) | call, call 0 being the control tag

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}  # on the wire
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_REQUEST = struct.Struct("<IIdQHHBBHHH")
_REPLY = struct.Struct("<QdBB")
_ERROR = struct.Struct("<HHI")


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
    call: int = 0  # names the reply's tag: reply_tag(client id, call); 0 = none
    trace: dict[str, str] | None = None  # W3C trace context (traceparent...) of a traced call


@dataclass(frozen=True)
class ReplyHeader:
    """The output tensor's layout; its bytes follow as the payload."""

    dtype: str
    shape: list[int]
    payload_bytes: int
    service_s: float = 0.0  # the service's own time for the call: queue + compute


@dataclass(frozen=True)
class ErrorHeader:
    """An error answered instead of a tensor; `code` names a gRPC status (or VERSION)."""

    code: str
    message: str
    field: str = ""


Header = RequestHeader | ReplyHeader | ErrorHeader
_KIND = {RequestHeader: Kind.REQUEST, ReplyHeader: Kind.REPLY, ErrorHeader: Kind.ERROR}


def encode_header(header: Header, version: int = VERSION, flags: int = 0, call: int = 0) -> bytes:
    """Message 1 of a frame without its payload; `call` (a request's) overrides header.call.
    `version` is a parameter only so tests can speak an older version."""
    try:
        if isinstance(header, RequestHeader):
            body = _encode_request(header, call or header.call)
        elif isinstance(header, ReplyHeader):
            body = _REPLY.pack(
                header.payload_bytes,
                header.service_s,
                DTYPE_CODES.get(header.dtype, 0),
                len(header.shape),
            ) + struct.pack(f"<{len(header.shape)}Q", *header.shape)
        else:
            code, field, message = (x.encode() for x in (header.code, header.field, header.message))
            body = _ERROR.pack(len(code), len(field), len(message)) + code + field + message
    except struct.error as e:  # a value beyond its field (a negative count, a huge id)
        raise FrameError("header", f"cannot be encoded: {e}") from None
    if len(body) > MAX_HEADER_BYTES:
        raise FrameError("header", f"{len(body)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    return _PREFIX.pack(MAGIC, version, _KIND[type(header)], flags, len(body)) + body


def _encode_request(h: RequestHeader, call: int) -> bytes:
    model, checksum = h.model_id.encode(), h.weights_checksum.encode()
    trace = json.dumps(h.trace, separators=(",", ":")).encode() if h.trace else b""
    n, m, d = len(h.expert_ids), len(h.token_counts), len(h.shape)
    return (
        _REQUEST.pack(
            h.layer,
            call,
            math.nan if h.timeout_ms is None else h.timeout_ms,
            h.payload_bytes,
            n,
            m,
            d,
            DTYPE_CODES.get(h.dtype, 0),
            len(model),
            len(checksum),
            len(trace),
        )
        + struct.pack(f"<{n}I{m}I{d}Q", *h.expert_ids, *h.token_counts, *h.shape)
        + model
        + checksum
        + trace
    )


def encode_frame(header: Header, payload: torch.Tensor | None = None, call: int = 0) -> list[Any]:
    """The messages of a frame (numpy byte arrays): one, with the payload inline when it is at
    most INLINE_MAX_BYTES, else the header and then a view of the (contiguous) tensor's memory.
    `call`: as in encode_header."""
    n = 0 if payload is None else payload.numel() * payload.element_size()
    if not n:
        return [np.frombuffer(encode_header(header, call=call), np.uint8)]
    if n > INLINE_MAX_BYTES:
        return [np.frombuffer(encode_header(header, call=call), np.uint8), payload_view(payload)]
    first = encode_header(header, flags=INLINE, call=call)
    offset = _payload_offset(len(first))
    message = np.empty(offset + n, np.uint8)
    message[: len(first)] = np.frombuffer(first, np.uint8)
    message[offset:] = payload_view(payload)
    return [message]


def _payload_offset(first_bytes: int) -> int:
    return -(-first_bytes // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def request_tag(client_id: int) -> int:
    return (client_id << 32) | 0xFFFF_FFFF


def reply_tag(client_id: int, call: int) -> int:
    return (client_id << 32) | call


def control_tag(client_id: int) -> int:
    """Where frame-level refusals go: the client fails its calls in flight and reconnects."""
    return reply_tag(client_id, 0)


MAX_CALL = 0xFFFF_FFFE  # request_tag's low bits are never a call's


def encode_hello(
    client_id: int, address: bytes, version: int = VERSION, proof: bytes = b""
) -> bytes:
    return (
        _HELLO.pack(HELLO_MAGIC, version, len(proof), client_id, zlib.crc32(address))
        + address
        + proof
    )


def decode_hello(message: bytes | memoryview) -> tuple[int, bytes, bytes]:
    """(client id, worker address, proof) of a hello; FrameError for anything else (nobody to
    tell: the receiver drops it). The CRC keeps corrupt or stray bytes from reaching UCX, which
    aborts the process on an address it cannot unpack; the proof (fastpath.auth, under mutual
    TLS) is what authenticates."""
    message = bytes(message)
    if not _HELLO.size < len(message) <= MAX_HELLO_BYTES:
        raise FrameError("hello", f"{len(message)} bytes is not a hello")
    magic, version, proof_bytes, client_id, crc = _HELLO.unpack_from(message)
    if magic != HELLO_MAGIC:
        raise FrameError("hello", f"expected {HELLO_MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise VersionError(version)
    if not 0 < client_id < 1 << CLIENT_ID_BITS:
        raise FrameError("hello", f"client id {client_id} out of range")
    if proof_bytes >= len(message) - _HELLO.size:
        raise FrameError("hello", f"a proof of {proof_bytes} bytes leaves no worker address")
    address = message[_HELLO.size : len(message) - proof_bytes]
    if zlib.crc32(address) != crc:
        raise FrameError("hello", "worker address fails its CRC")
    return client_id, address, message[len(message) - proof_bytes :]


def decode_frame(
    message: np.ndarray, max_payload_bytes: int
) -> tuple[Header, torch.Tensor | None, bool]:
    """Message 1 as (header, inline payload or None, whether the payload follows as message 2).

    The inline payload is a view of `message` (no copy). Raises as decode_header does, and
    FrameError when an inline payload is shorter or longer than announced."""
    header, flags, first_bytes = _decode(memoryview(message), max_payload_bytes)
    n = getattr(header, "payload_bytes", 0)
    if not n:
        return header, None, False
    if not flags & INLINE:
        return header, None, True
    offset = _payload_offset(first_bytes)
    check_payload_length(header, max(0, len(message) - offset))
    dtype = DTYPES[header.dtype]
    data = torch.frombuffer(message, dtype=dtype, offset=offset, count=n // dtype.itemsize)
    return header, data.view(header.shape), False


def decode_header(message: memoryview | bytes, max_payload_bytes: int) -> Header:
    """Parse message 1 (received whole: its length is probed first).

    Raises VersionError for another version and FrameError for anything else malformed: garbage,
    a header over the limit, a payload size that does not match dtype x shape or exceeds
    `max_payload_bytes`."""
    return _decode(memoryview(message), max_payload_bytes)[0]


def _decode(message: memoryview, max_payload_bytes: int) -> tuple[Header, int, int]:
    """(header, flags, bytes of prefix + header)."""
    if len(message) < PREFIX_BYTES:
        raise FrameError("prefix", f"{len(message)} bytes; a frame starts with {PREFIX_BYTES}")
    magic, version, kind, flags, length = _PREFIX.unpack_from(message)
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
    body = message[PREFIX_BYTES : PREFIX_BYTES + length]
    try:
        kind = Kind(kind)
    except ValueError:
        raise FrameError("kind", f"{kind} is not a frame kind") from None
    try:
        if kind is Kind.REQUEST:
            header = _decode_request(body)
        elif kind is Kind.REPLY:
            header = _decode_reply(body)
        else:
            header = _decode_error(body)
            return header, flags, PREFIX_BYTES + length
    except (struct.error, UnicodeDecodeError) as e:
        raise FrameError("header", f"cannot be read: {e}") from None
    _check_payload(header, max_payload_bytes)
    return header, flags, PREFIX_BYTES + length


def _fits(body: memoryview, needs: int) -> None:
    if len(body) != needs:
        raise FrameError("header", f"{len(body)} bytes, where its fields need {needs}")


def _dtype(code: int) -> str:
    name = _CODE_DTYPES.get(code)
    if name is None:
        raise FrameError(
            "dtype",
            f"unsupported dtype code {code}; expected one of "
            + ", ".join(f"{c} ({n})" for n, c in DTYPE_CODES.items()),
        )
    return name


def _decode_request(body: memoryview) -> RequestHeader:
    layer, call, timeout_ms, payload_bytes, n, m, d, dtype, lm, lc, lt = _REQUEST.unpack_from(body)
    lists = struct.Struct(f"<{n}I{m}I{d}Q")
    _fits(body, _REQUEST.size + lists.size + lm + lc + lt)
    values = lists.unpack_from(body, _REQUEST.size)
    at = _REQUEST.size + lists.size
    model = str(body[at : at + lm], "utf-8")
    checksum = str(body[at + lm : at + lm + lc], "utf-8")
    trace = None
    if lt:
        try:
            trace = json.loads(bytes(body[at + lm + lc :]))
        except ValueError:
            trace = None  # refused below
        if not (
            isinstance(trace, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in trace.items())
        ):
            raise FrameError("trace", "expected a map of strings (W3C trace context)")
    if call > MAX_CALL:
        raise FrameError("call", f"expected a call number, got {call}")
    return RequestHeader(
        model,
        checksum,
        layer,
        list(values[:n]),
        list(values[n : n + m]),
        _dtype(dtype),
        list(values[n + m :]),
        payload_bytes,
        None if math.isnan(timeout_ms) else timeout_ms,
        call,
        trace,
    )


def _decode_reply(body: memoryview) -> ReplyHeader:
    payload_bytes, service_s, dtype, d = _REPLY.unpack_from(body)
    _fits(body, _REPLY.size + 8 * d)
    if not 0 <= service_s < math.inf:  # NaN fails too
        raise FrameError("service_s", f"expected seconds >= 0, got {service_s!r}")
    shape = list(struct.unpack_from(f"<{d}Q", body, _REPLY.size))
    return ReplyHeader(_dtype(dtype), shape, payload_bytes, service_s)


def _decode_error(body: memoryview) -> ErrorHeader:
    lc, lf, lm = _ERROR.unpack_from(body)
    _fits(body, _ERROR.size + lc + lf + lm)
    at = _ERROR.size
    code, field, message = (
        str(body[a:b], "utf-8")
        for a, b in ((at, at + lc), (at + lc, at + lc + lf), (at + lc + lf, at + lc + lf + lm))
    )
    return ErrorHeader(code, message, field)


def check_payload_length(header: RequestHeader | ReplyHeader, received: int) -> None:
    """Raises FrameError unless message 2 carried exactly the announced bytes."""
    n = header.payload_bytes
    if received < n:
        raise FrameError(
            "payload", f"short payload: header announces {n} bytes, {received} were sent"
        )
    if received > n:
        raise FrameError("payload", f"more than the {n} bytes announced were sent ({received})")


def _check_payload(header: RequestHeader | ReplyHeader, max_payload_bytes: int) -> None:
    if header.dtype not in DTYPES:
        raise FrameError(
            "dtype", f"unsupported dtype {header.dtype!r}; expected one of {', '.join(DTYPES)}"
        )
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


# -- errors across the fast path: the classes and codes of gRPC (common.errors.CODE_NAMES) -------


def error_header(error: errors.MoeMeshError) -> ErrorHeader:
    code = getattr(error, "code", None) or errors.code_name(error)
    return ErrorHeader(code=code, message=str(error), field=getattr(error, "field", "") or "")


def error_from_header(header: ErrorHeader, peer: str) -> errors.MoeMeshError:
    """The exception a gRPC caller would get for the same status; unlisted codes count as unavailable."""
    cls = errors.FROM_CODE_NAME.get(header.code, errors.UnavailableError)
    return cls(f"{peer}: {header.code}: {header.message}")
