"""common/status.py: our errors become the gRPC status (and trailers) their servicer aborts with,
and a peer's status becomes the error its caller raises, naming the peer when asked."""

from __future__ import annotations

import grpc
import pytest

from common import errors
from common.status import (
    EXPERTS_UNAVAILABLE_KEY,
    RETRY_AFTER_KEY,
    abort_with,
    error_from_rpc,
    status_code,
)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.InvalidArgumentError("top_p", "must be in (0, 1]"), "INVALID_ARGUMENT"),
        (errors.CapacityError("prompt", "too long"), "INVALID_ARGUMENT"),
        (errors.AlreadyExistsError("request_id", "'a' in flight"), "ALREADY_EXISTS"),
        (errors.NotFoundError("layer 9"), "NOT_FOUND"),
        (errors.PreconditionError("weights_checksum differs"), "FAILED_PRECONDITION"),
        (errors.ResourceExhaustedError("busy", 1.5), "RESOURCE_EXHAUSTED"),
        (errors.UnavailableError("no replica"), "UNAVAILABLE"),
        (errors.DeadlineExceededError("late"), "DEADLINE_EXCEEDED"),
        (errors.InternalError("a bug"), "INTERNAL"),
        (errors.MoeMeshError("unclassified"), "INTERNAL"),
    ],
)
def test_each_error_has_its_status_code(error, code) -> None:
    assert status_code(error) == grpc.StatusCode[code]


class Context:
    """What abort_with asks of a servicer context: abort (which, like gRPC's, raises)."""

    def __init__(self) -> None:
        self.aborted: list[tuple] = []

    async def abort(self, code, details, trailing_metadata=()) -> None:
        self.aborted.append((code, details, tuple(trailing_metadata)))
        raise RuntimeError("aborted")


class Counter:
    def __init__(self) -> None:
        self.added: list[tuple[int, dict]] = []

    def add(self, n: int, attributes: dict) -> None:
        self.added.append((n, attributes))


@pytest.mark.parametrize(
    ("error", "trailers"),
    [
        (errors.ResourceExhaustedError("queue full", 2.5), ((RETRY_AFTER_KEY, "2.5"),)),
        (errors.ExpertUnavailableError(3, [1, 2], "down"), ((EXPERTS_UNAVAILABLE_KEY, "1"),)),
        (errors.NotFoundError("layer 9"), ()),
    ],
)
async def test_abort_with_sends_the_code_the_message_and_its_trailers_and_counts_it(
    error, trailers
) -> None:
    context, counter = Context(), Counter()
    with pytest.raises(RuntimeError, match="aborted"):
        await abort_with(context, error, counter)
    assert context.aborted == [(status_code(error), str(error), trailers)]
    assert counter.added == [(1, {"rpc.grpc.status_code": status_code(error).name})]


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("NOT_FOUND", errors.NotFoundError),
        ("FAILED_PRECONDITION", errors.PreconditionError),
        ("UNAUTHENTICATED", errors.UnauthenticatedError),
        ("UNAVAILABLE", errors.UnavailableError),
        ("DEADLINE_EXCEEDED", errors.DeadlineExceededError),
        ("INVALID_ARGUMENT", errors.MoeMeshError),  # our own request was malformed: a bug
        ("DATA_LOSS", errors.UnavailableError),  # unlisted codes count as unavailable
        ("INTERNAL", errors.UnavailableError),
    ],
)
def test_a_peers_status_is_the_error_its_caller_raises(code, cls) -> None:
    e = error_from_rpc(rpc_error(grpc.StatusCode[code], "went wrong"))
    assert type(e) is cls and str(e) == f"{code}: went wrong"
    named = error_from_rpc(rpc_error(grpc.StatusCode[code], "went wrong"), peer="10.0.0.1:5")
    assert str(named) == f"10.0.0.1:5: {code}: went wrong"
    cleaned = error_from_rpc(rpc_error(grpc.StatusCode[code], "at 10.0.0.1:5"), details="gone")
    assert str(cleaned) == f"{code}: gone"


def test_already_exists_from_a_peer_names_the_field_its_details_start_with() -> None:
    e = error_from_rpc(rpc_error(grpc.StatusCode.ALREADY_EXISTS, "request_id: 'a' in flight"))
    assert isinstance(e, errors.AlreadyExistsError) and e.field == "request_id"
    assert str(e) == "request_id: 'a' in flight"
    at_peer = error_from_rpc(
        rpc_error(grpc.StatusCode.ALREADY_EXISTS, "session: taken"), peer="r:1"
    )
    assert (at_peer.field, str(at_peer)) == ("session", "session: taken (at r:1)")
    bare = error_from_rpc(rpc_error(grpc.StatusCode.ALREADY_EXISTS, "in flight already"))
    assert (bare.field, str(bare)) == ("request_id", "request_id: in flight already")
