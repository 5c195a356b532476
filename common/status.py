"""Map moe-mesh errors to gRPC status codes and back. Only servicers and gRPC clients import this."""

from __future__ import annotations

import grpc

from common import errors


def status_code(error: errors.MoeMeshError) -> grpc.StatusCode:
    return grpc.StatusCode[errors.code_name(error)]


RETRY_AFTER_KEY = "retry-after-s"
# Trailer of an UNAVAILABLE that is about the expert replicas behind the service that sent it, not
# that service: a gateway keeps the router and does not retry the request on another one.
EXPERTS_UNAVAILABLE_KEY = "moe-experts-unavailable"
# A router's named health service: SERVING while its every MoE layer's every expert has a replica
# (colocated or remote) and the router itself serves. Gateways watch it for their readiness.
EXPERTS_HEALTH = "moe-mesh.experts"


async def abort_with(
    context: grpc.aio.ServicerContext, error: errors.MoeMeshError, counter=None
) -> None:
    """End the RPC with the status that matches `error`; its message is sent as the details.

    A ResourceExhaustedError also carries its retry hint as trailing metadata `retry-after-s`, an
    ExpertUnavailableError the EXPERTS_UNAVAILABLE_KEY trailer.
    `counter` (an OpenTelemetry counter) counts the failure by status code.
    """
    if counter is not None:
        counter.add(1, {"rpc.grpc.status_code": status_code(error).name})
    trailers: tuple[tuple[str, str], ...] = ()
    if isinstance(error, errors.ResourceExhaustedError):
        trailers = ((RETRY_AFTER_KEY, f"{error.retry_after_s:g}"),)
    elif isinstance(error, errors.ExpertUnavailableError):
        trailers = ((EXPERTS_UNAVAILABLE_KEY, "1"),)
    await context.abort(status_code(error), str(error), trailing_metadata=trailers)


_FROM_CODE: dict[grpc.StatusCode, type[errors.MoeMeshError]] = {
    **{grpc.StatusCode[name]: cls for name, cls in errors.FROM_CODE_NAME.items()},
    # Only gRPC callers meet it (a request id in flight); its details name the field.
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExistsError,
}


def error_from_rpc(
    e: grpc.aio.AioRpcError, peer: str | None = None, details: str | None = None
) -> errors.MoeMeshError:
    """Our exception for a failed outgoing call. Unlisted codes count as unavailable.

    The message names `peer` when given: internal hops want it in their errors and logs, while an
    edge that answers the public (the gateway) leaves it out, logs it instead, and may pass the call's
    `details` cleaned of internal addresses.
    """
    cls = _FROM_CODE.get(e.code(), errors.UnavailableError)
    details = (e.details() or "") if details is None else details
    message = f"{e.code().name}: {details}"
    if peer is not None:
        message = f"{peer}: {message}"
    if cls is errors.AlreadyExistsError:
        # Our servers start an error's details with the field it concerns ("request_id: ...").
        field, sep, rest = details.partition(": ")
        if not (sep and field.isidentifier()):
            field, rest = "request_id", details
        return errors.AlreadyExistsError(field, rest if peer is None else f"{rest} (at {peer})")
    return cls(message)
