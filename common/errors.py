"""moe-mesh's exception tree. Services map these to gRPC / HTTP statuses at their edges.

MoeMeshError                                                           gRPC status / HTTP
├── CheckpointError        a checkpoint cannot be read or does not match its config (names file and tensor)
│   └── UnsupportedModelError   valid checkpoint of a model or feature moe-mesh does not serve
├── InvalidArgumentError   bad input; names the field and the limit               INVALID_ARGUMENT / 400
│   └── CapacityError         a request can never fit (context length, batch limits)
├── AlreadyExistsError     a request id is already in flight                       ALREADY_EXISTS / 409
├── NotFoundError          an addressed thing (layer, expert, model) is not here  NOT_FOUND / 404
├── PreconditionError      caller and server disagree (model id, weights)         FAILED_PRECONDITION / 400
├── ResourceExhaustedError queue full; retry after `retry_after_s`             RESOURCE_EXHAUSTED / 429
├── UnavailableError       no reachable replica; retryable elsewhere              UNAVAILABLE / 503
│   └── ExpertUnavailableError  names the layer and experts that could not be reached
├── DeadlineExceededError  the request's deadline passed                           DEADLINE_EXCEEDED / 504
└── InternalError          a bug or a numeric failure, not the caller's doing      INTERNAL / 500

Services map these to statuses in their servicers (common/status.py); cores never import grpc.
"""

from __future__ import annotations


class MoeMeshError(Exception):
    """Base of every error moe-mesh raises on purpose."""


class CheckpointError(MoeMeshError):
    """A checkpoint directory is missing, corrupt, or inconsistent with its config."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None) -> None:
        where = ", ".join(
            p for p in (f"file {file}" if file else "", f"tensor {tensor!r}" if tensor else "") if p
        )
        super().__init__(f"{message} ({where})" if where else message)
        self.file = file
        self.tensor = tensor


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable, but its architecture or a feature it enables is not supported."""


class InvalidArgumentError(MoeMeshError):
    """An input field is invalid; `field` names it and the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CapacityError(InvalidArgumentError):
    """A request exceeds a hard limit of the server (e.g. prompt + max_tokens > max_model_len)."""


class AlreadyExistsError(MoeMeshError):
    """The caller chose an identifier (a request id) that is already in use."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFoundError(MoeMeshError):
    """The addressed layer, expert or model is not served here."""


class ModelNotFoundError(NotFoundError):
    """A request names a model this server does not serve (OpenAI's 404 `model_not_found`)."""

    field = "model"


class PreconditionError(MoeMeshError):
    """Caller and server disagree about what they serve (model id, weights checksum)."""


class UnauthenticatedError(MoeMeshError):
    """The caller brought no credentials, or ones this server does not accept."""


class ResourceExhaustedError(MoeMeshError):
    """Admission refused: every slot and queue place is taken. Retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry after {retry_after_s:g}s")
        self.retry_after_s = retry_after_s


class UnavailableError(MoeMeshError):
    """No reachable replica could serve the call; another replica or a later retry may succeed."""


class ExpertUnavailableError(UnavailableError):
    """No replica of some experts of a layer is reachable."""

    def __init__(self, layer: int, experts: list[int], detail: str = "") -> None:
        names = ", ".join(str(e) for e in sorted(experts))
        super().__init__(
            f"no reachable replica for layer {layer} expert(s) {names}"
            + (f": {detail}" if detail else "")
        )
        self.layer, self.experts = layer, sorted(experts)


class DeadlineExceededError(MoeMeshError):
    """The request's deadline passed before it completed."""


class InternalError(MoeMeshError):
    """Something failed that the caller could not have caused (a bug, a kernel error); names what failed."""


# The status each class travels as, by gRPC status code name: a gRPC status (common/status.py) and
# a fast-path error frame (common/fastpath/frame.py) carry the same one. First match wins; any
# other error is INTERNAL.
CODE_NAMES: list[tuple[type[MoeMeshError], str]] = [
    (InvalidArgumentError, "INVALID_ARGUMENT"),
    (AlreadyExistsError, "ALREADY_EXISTS"),
    (NotFoundError, "NOT_FOUND"),
    (PreconditionError, "FAILED_PRECONDITION"),
    (UnauthenticatedError, "UNAUTHENTICATED"),
    (ResourceExhaustedError, "RESOURCE_EXHAUSTED"),
    (UnavailableError, "UNAVAILABLE"),
    (DeadlineExceededError, "DEADLINE_EXCEEDED"),
    (CheckpointError, "FAILED_PRECONDITION"),
]


def code_name(error: MoeMeshError) -> str:
    return next((name for cls, name in CODE_NAMES if isinstance(error, cls)), "INTERNAL")


# What a caller raises for a peer's status, by code name; unlisted codes count as unavailable.
# INVALID_ARGUMENT from a peer means our own request was malformed: a bug, not bad input, hence
# the base class.
FROM_CODE_NAME: dict[str, type[MoeMeshError]] = {
    "INVALID_ARGUMENT": MoeMeshError,
    "NOT_FOUND": NotFoundError,
    "FAILED_PRECONDITION": PreconditionError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
}
