"""The fast path's frame codec, without UCX: round trips, and a FrameError naming the field for every
malformed frame (garbage, other versions, oversized header, byte counts, size limit, short payload,
hellos that are not one), and the worker-address advertisement."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest
import torch

from common import errors, status
from common.fastpath import MAX_ADVERTISED_CHARS, parse_worker_url, worker_url
from common.fastpath import frame as f

LIMIT = 1 << 20


def request(**overrides) -> f.RequestHeader:
    fields = dict(
        model_id="m",
        weights_checksum="sha256:abc",
        layer=1,
        expert_ids=[3, 0],
        token_counts=[2, 1],
        dtype="bfloat16",
        shape=[3, 64],
        payload_bytes=3 * 64 * 2,
        timeout_ms=250.0,
        call=7,
    )
    return f.RequestHeader(**{**fields, **overrides})


def raw(version: int = f.VERSION, kind: int = 1, body: bytes = b"{}", length: int | None = None):
    n = len(body) if length is None else length
    return struct.pack("<4sHBBI", f.MAGIC, version, kind, 0, n) + body


def refused(message: bytes, limit: int = LIMIT) -> f.FrameError:
    with pytest.raises(f.FrameError) as info:
        f.decode_header(message, limit)
    return info.value


@pytest.mark.parametrize(
    "header",
    [
        request(),
        request(timeout_ms=None),
        request(trace={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}),
        request(model_id="modèle", expert_ids=[], token_counts=[]),
        f.ReplyHeader("float32", [2, 8], 64),
        f.ReplyHeader("float32", [2, 8], 64, service_s=0.0125),
        f.ErrorHeader("NOT_FOUND", "layer 9", ""),
    ],
)
def test_headers_round_trip(header) -> None:
    message = f.encode_header(header)
    assert message[:4] == f.MAGIC and len(message) <= f.FIRST_MESSAGE_BYTES
    # Received into the fixed buffer: whatever follows the header is ignored.
    assert f.decode_header(message + b"\0" * 100, LIMIT) == header


def test_garbage_and_short_prefixes_are_refused() -> None:
    assert refused(b"GET / HTTP/1.1\r\n\r\n").field == "magic"
    assert refused(b"MMF").field == "prefix"
    assert refused(raw(body=b"not a header")).field == "header"
    assert refused(raw(kind=7, body=b"{}")).field == "kind"
    whole = f.encode_header(request())
    body = whole[f.PREFIX_BYTES :]
    for cut in (body[:-1], body + b"x"):  # its lists and strings say how long it must be
        e = refused(raw(body=cut))
        assert e.field == "header" and f"fields need {len(body)}" in str(e)
    e = refused(raw(body=body.replace(b"sha256:abc", b"sha256:\xff\xfe\xfd")))
    assert e.field == "header" and "utf-8" in str(e)


def reply_body(service_s: float) -> bytes:
    return struct.pack("<QdBBQQ", 8, service_s, f.DTYPE_CODES["float32"], 2, 1, 2)


@pytest.mark.parametrize("service_s", [-1.0, float("nan"), float("inf")])
def test_a_reply_must_say_its_service_time_in_seconds(service_s: float) -> None:
    assert refused(raw(kind=f.Kind.REPLY, body=reply_body(service_s))).field == "service_s"
    assert f.decode_header(raw(kind=f.Kind.REPLY, body=reply_body(0.5)), LIMIT).service_s == 0.5


@pytest.mark.parametrize("version", [0, f.VERSION + 1])
def test_other_versions_are_refused_with_a_version_error_naming_both(version) -> None:
    e = refused(raw(version=version, body=b"{}"))
    assert isinstance(e, f.VersionError) and e.code == "VERSION"
    assert f"version {version}" in str(e) and f"version {f.VERSION}" in str(e)
    assert f.encode_header(request(), version=version)[4:6] == struct.pack("<H", version)


def test_an_oversized_header_is_refused_from_its_prefix_before_it_is_read() -> None:
    e = refused(raw(body=b"{}", length=f.MAX_HEADER_BYTES + 1))
    assert e.field == "header" and str(f.MAX_HEADER_BYTES) in str(e)
    with pytest.raises(f.FrameError, match="header"):
        f.encode_header(request(model_id="x" * f.MAX_HEADER_BYTES))
    assert refused(raw(body=b"{}", length=100)).field == "header"  # announced more than arrived


def test_payload_byte_count_must_match_dtype_times_shape_and_fit_the_limit() -> None:
    e = refused(f.encode_header(request(payload_bytes=3 * 64 * 2 - 1)))
    assert e.field == "payload_bytes" and "needs 384" in str(e)
    e = refused(f.encode_header(request(dtype="int8")))
    assert e.field == "dtype" and "1 (float32)" in str(e)
    e = refused(f.encode_header(request()), limit=100)
    assert e.field == "payload_bytes" and e.code == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"trace": {"traceparent": 7}}, "trace"),
        ({"call": f.MAX_CALL + 1}, "call"),
    ],
)
def test_fields_outside_their_range_are_refused_by_name(overrides, field) -> None:
    assert refused(f.encode_header(request(**overrides))).field == field


@pytest.mark.parametrize(
    "overrides", [{"expert_ids": [1, -2]}, {"layer": 2**32}, {"shape": [3, -64]}, {"layer": "1"}]
)
def test_what_the_layout_cannot_carry_is_refused_when_encoded(overrides) -> None:
    with pytest.raises(f.FrameError, match="header: cannot be encoded"):
        f.encode_header(request(**overrides))


def test_the_probed_payload_length_must_match_the_header_exactly() -> None:
    f.check_payload_length(request(), 384)
    with pytest.raises(f.FrameError, match="short payload: header announces 384 bytes, 300"):
        f.check_payload_length(request(), 300)
    with pytest.raises(f.FrameError, match="more than the 384 bytes"):
        f.check_payload_length(request(), 385)


def test_hellos_round_trip_and_anything_else_is_refused() -> None:
    address = bytes(range(188))
    assert f.decode_hello(f.encode_hello(5, address)) == (5, address, b"")
    assert f.decode_hello(f.encode_hello(5, address, proof=b"p" * 9)) == (5, address, b"p" * 9)
    hello = f.encode_hello(5, address)
    for bad in [
        b"",
        b"MMFH",
        b"GET / HTTP/1.1\r\n\r\n" * 4,
        hello[:-1] + b"!",  # the address fails its CRC (UCX would abort on it)
        f.encode_hello(0, address),
        f.encode_hello(1 << f.CLIENT_ID_BITS, address),
        f.encode_hello(5, b"x" * f.MAX_HELLO_BYTES),
        f.encode_hello(5, b"", proof=b"x" * 64),  # a proof leaving no address
    ]:
        with pytest.raises(f.FrameError):
            f.decode_hello(bad)
    with pytest.raises(f.VersionError):
        f.decode_hello(f.encode_hello(5, address, version=1))


def test_tags_of_clients_and_calls_never_meet() -> None:
    ids = [1, 2, (1 << f.CLIENT_ID_BITS) - 1]
    tags = {f.request_tag(i) for i in ids} | {f.reply_tag(i, c) for i in ids for c in (1, 2)}
    hellos = {f.hello_tag(n) for n in (1, 2, 0xFFFF)}
    tags |= {f.control_tag(i) for i in ids} | hellos
    assert len(tags) == len(ids) * 4 + 3 and max(tags) < 1 << 64


def test_payloads_are_views_of_the_tensor_and_received_into_the_output_tensor() -> None:
    t = torch.randn(3, 64).to(torch.bfloat16)
    view = f.payload_view(t)
    assert view.nbytes == 384 and view.ctypes.data == t.data_ptr()  # no copy
    out = f.empty_like_payload(request())
    f.payload_view(out)[:] = view
    assert torch.equal(out, t)


def test_small_payloads_travel_inline_and_are_received_as_views_of_the_message() -> None:
    t = torch.randn(3, 64).to(torch.bfloat16)
    (message,) = f.encode_frame(request(), t)  # one message: one wake-up of the receiver
    header, payload, follows = f.decode_frame(message, LIMIT)
    assert header == request() and not follows and torch.equal(payload, t)
    assert payload.data_ptr() == message.ctypes.data + message.nbytes - 384  # no copy
    assert payload.data_ptr() % 16 == 0  # the message's alignment, kept by PAYLOAD_ALIGN


def test_large_payloads_follow_from_the_tensors_own_memory() -> None:
    rows = f.INLINE_MAX_BYTES // (64 * 2) + 1
    t = torch.randn(rows, 64).to(torch.bfloat16)
    big = request(token_counts=[rows], shape=[rows, 64], payload_bytes=t.nbytes)
    first, rest = f.encode_frame(big, t)
    assert f.decode_frame(first, LIMIT) == (big, None, True)
    assert rest.ctypes.data == t.data_ptr()  # no copy


def test_an_inline_payload_must_be_exactly_as_long_as_announced() -> None:
    (message,) = f.encode_frame(request(), torch.randn(3, 64).to(torch.bfloat16))
    with pytest.raises(f.FrameError, match="short payload"):
        f.decode_frame(message[:-1], LIMIT)
    with pytest.raises(f.FrameError, match="more than the 384 bytes"):
        f.decode_frame(np.concatenate([message, message[:1]]), LIMIT)


def test_error_frames_carry_the_same_classes_as_grpc_statuses() -> None:
    samples = [
        errors.InvalidArgumentError("hidden", "bad"),
        errors.NotFoundError("layer 9"),
        errors.PreconditionError("weights"),
        errors.ResourceExhaustedError("full", 1.0),
        errors.UnavailableError("gone"),
        errors.DeadlineExceededError("late"),
        errors.InternalError("bug"),
    ]
    for error in samples:
        header = f.error_header(error)
        assert header.code == status.status_code(error).name
        assert header.message == str(error)
        got = f.error_from_header(header, "peer")
        rpc = grpc.aio.AioRpcError(status.status_code(error), None, None, details=str(error))
        want = status.error_from_rpc(rpc, "peer")
        assert type(got) is type(want) and str(got) == str(want)
    assert f.error_header(errors.InvalidArgumentError("hidden", "bad")).field == "hidden"


def test_worker_addresses_are_advertised_within_the_registry_limit() -> None:
    address = bytes(range(188))  # shared memory + TCP
    url = worker_url(address, 0xFFFF)
    assert url.startswith("ucx-worker:") and len(url) <= MAX_ADVERTISED_CHARS
    assert parse_worker_url(url) == (address, 0xFFFF)
    assert parse_worker_url(["ucx://127.0.0.1:4000", "ucx-worker:!!/1", url]) == (address, 0xFFFF)
    assert parse_worker_url("") is None and parse_worker_url([]) is None
    assert parse_worker_url(["ucx://127.0.0.1:4000"]) is None  # a version-1 service: gRPC
    # No server number, or one outside the hello tag's 16 bits: not an address we can say hello to.
    bare = url.rpartition("/")[0]
    assert parse_worker_url([bare, f"{bare}/0", f"{bare}/65536", f"{bare}/x"]) is None
    with pytest.raises(ValueError, match="narrow UCX_TLS"):
        worker_url(bytes(400), 1)
