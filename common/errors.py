"""moe-mesh's exception tree. Services map these to gRPC / HTTP statuses at their edges.

MoeMeshError
├── CheckpointError        a checkpoint cannot be read or does not match its config (names file and tensor)
│   └── UnsupportedModelError   valid checkpoint of a model or feature moe-mesh does not serve
├── InvalidRequestError    bad client input (names the field and the limit)       → INVALID_ARGUMENT / 400
└── CapacityError          a request can never fit (context, batch limits)        → INVALID_ARGUMENT / 400
"""

from __future__ import annotations


class MoeMeshError(Exception):
    """Base of every error moe-mesh raises on purpose."""


class CheckpointError(MoeMeshError):
    """A checkpoint directory is missing, corrupt, or inconsistent with its config."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None) -> None:
        where = ", ".join(p for p in (f"file {file}" if file else "", f"tensor {tensor!r}" if tensor else "") if p)
        super().__init__(f"{message} ({where})" if where else message)
        self.file = file
        self.tensor = tensor


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable, but its architecture or a feature it enables is not supported."""


class InvalidRequestError(MoeMeshError):
    """A request field is invalid; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CapacityError(InvalidRequestError):
    """A request exceeds a hard limit of the server (e.g. prompt + max_tokens > max_model_len)."""
