"""Activations between host memory, which the wire decodes into and encodes from, and the device a
service computes on.

On a GPU, one job's inputs go in through one pinned host buffer and its outputs come back through
another, each kept and grown on demand (pinning locks every page of an allocation in the kernel:
done once, not per call), with non-blocking copies and one synchronize per job before
host code reads a result. Pinned because a "non-blocking" copy from pageable memory is silently a
synchronous one. On the CPU the stager is the identity: inputs are joined as before, outputs
returned as computed, nothing copied.

The device calls are one small protocol (DeviceOps): CudaOps on a GPU, a fake in the tests
(tests/unit/common/test_staging.py) that records the copies and holds results back until the
synchronize, so the staging logic is tested where no GPU is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

# Where each tensor starts in a buffer: a multiple of any element size, and of a cache line.
ALIGN = 64
# The smallest buffer pinned: small jobs then share one allocation as they grow.
MIN_PINNED_BYTES = 1 << 20


class DeviceOps(Protocol):
    """The device-specific calls a Stager makes; all copies are enqueued, none waits."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer: uint8 [nbytes]."""
        ...

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of `host` (a view of a pinned buffer), enqueued: `host` must not change
        until the next synchronize."""
        ...

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue dst.copy_(src): `dst` (a view of a pinned buffer) holds it after synchronize."""
        ...

    def synchronize(self) -> None:
        """Wait until every copy and computation enqueued so far has completed."""
        ...


class CudaOps:
    """DeviceOps on one CUDA device, on its current stream (the compute thread's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))  # [rows, hidden]


class Stager:
    """Moves one job at a time: `to_device` its inputs, compute, `to_host` its outputs.

    Not thread-safe: one per compute thread. On the CPU it copies nothing."""

    def __init__(self, device: torch.device, ops: DeviceOps | None = None) -> None:
        self.device = device
        self.ops = ops if ops is not None else (CudaOps(device) if device.type == "cuda" else None)
        self._buffers: dict[str, torch.Tensor] = {}  # "in" / "out": pinned uint8
        self._in_flight = False  # an input copy enqueued and not yet waited for

    @property
    def identity(self) -> bool:
        """Whether tensors stay where they are (the CPU)."""
        return self.ops is None

    def to_device(self, groups: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """Each group's host parts, joined along rows, on the device: one host-to-device copy."""
        if self.ops is None:
            return [_joined(parts) for parts in groups]
        if self._in_flight:  # the last job's inputs may still be copying out of the buffer
            self.ops.synchronize()
        layout, total = self._layout([_joined_shape(parts) for parts in groups])
        buffer = self._buffer("in", total)
        for parts, (offset, shape, dtype) in zip(groups, layout):
            for p in parts:  # joined by writing each part in place: no torch.cat on the host
                _view(buffer, offset, (p.shape[0], *shape[1:]), dtype).copy_(p)
                offset += _nbytes(p)
        device = self.ops.to_device(buffer[:total])
        self._in_flight = True
        return [_view(device, offset, shape, dtype) for offset, shape, dtype in layout]

    def to_host(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs in host memory the caller owns (the buffer is reused by the next job):
        one device-to-host copy each, then one synchronize."""
        if self.ops is None:
            return list(outputs)
        layout, total = self._layout([(tuple(o.shape), o.dtype) for o in outputs])
        buffer = self._buffer("out", total)
        for out, (offset, shape, dtype) in zip(outputs, layout):
            self.ops.to_host(_view(buffer, offset, shape, dtype), out)
        self.ops.synchronize()
        self._in_flight = False
        host = buffer[:total].clone()  # one host copy, so the next job may reuse the buffer
        return [_view(host, offset, shape, dtype) for offset, shape, dtype in layout]

    @staticmethod
    def _layout(
        tensors: Sequence[tuple[tuple[int, ...], torch.dtype]],
    ) -> tuple[list[tuple[int, tuple[int, ...], torch.dtype]], int]:
        """(byte offset, shape, dtype) of each tensor packed in one buffer, and the bytes used."""
        layout, offset = [], 0
        for shape, dtype in tensors:
            layout.append((offset, shape, dtype))
            offset += _aligned(dtype.itemsize * _numel(shape))
        return layout, offset

    def _buffer(self, direction: str, nbytes: int) -> torch.Tensor:
        """The pinned buffer of `direction`, at least `nbytes`: grown by doubling, never shrunk."""
        buffer = self._buffers.get(direction)
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, MIN_PINNED_BYTES, 2 * (0 if buffer is None else buffer.numel()))
            buffer = self._buffers[direction] = self.ops.pinned(size)  # type: ignore[union-attr]
        return buffer


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _joined_shape(parts: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of the parts joined along rows; they must agree on the rest."""
    first = parts[0]
    for p in parts[1:]:
        if p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"parts to join differ: {first.dtype} {list(first.shape)} and "
                f"{p.dtype} {list(p.shape)}"
            )
    return (sum(p.shape[0] for p in parts), *first.shape[1:]), first.dtype


def _view(
    buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """`shape` of `dtype` at byte `offset` of a uint8 buffer (offset a multiple of ALIGN)."""
    nbytes = dtype.itemsize * _numel(shape)
    return buffer[offset : offset + nbytes].view(dtype).view(shape)
