"""Tensors on the wire: moe_mesh.v1.Tensor is dtype + shape + raw little-endian bytes.

Encoding copies once (tensor -> bytes); decoding copies once (bytes -> a writable tensor).
"""

from __future__ import annotations

import torch

from common.errors import InvalidArgumentError
from protos.moe_mesh.v1 import tensor_pb2

TO_WIRE = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}


def dtype_name(wire_dtype: int) -> str:
    return (
        tensor_pb2.DType.Name(wire_dtype)
        if wire_dtype in tensor_pb2.DType.values()
        else str(wire_dtype)
    )


def encode(t: torch.Tensor) -> tensor_pb2.Tensor:
    """A 2-D-or-any tensor of a supported float dtype as a wire Tensor."""
    if t.dtype not in TO_WIRE:
        raise InvalidArgumentError(
            "dtype", f"{t.dtype} cannot be sent; supported: float32, bfloat16, float16"
        )
    raw = (
        t.detach().contiguous().view(torch.uint8).numpy().tobytes()
    )  # bfloat16 has no numpy dtype: send bytes
    return tensor_pb2.Tensor(dtype=TO_WIRE[t.dtype], shape=list(t.shape), data=raw)


def decode(msg: tensor_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    """The tensor a wire Tensor carries; InvalidArgumentError names `field` when it is malformed."""
    if msg.dtype not in FROM_WIRE:
        raise InvalidArgumentError(
            f"{field}.dtype",
            f"unsupported dtype {dtype_name(msg.dtype)}; expected one of "
            f"{', '.join(tensor_pb2.DType.Name(d) for d in FROM_WIRE)}",
        )
    dtype = FROM_WIRE[msg.dtype]
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"{field}.shape", f"negative dimension in {shape}")
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * dtype.itemsize
    if len(msg.data) != expected:
        raise InvalidArgumentError(
            f"{field}.data",
            f"has {len(msg.data)} bytes; shape {shape} of {dtype_name(msg.dtype)} needs {expected}",
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).view(shape)
