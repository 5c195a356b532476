"""Tensors on the wire: exact round trips per dtype and shape, and malformed messages named by field."""

from __future__ import annotations

import pytest
import torch

from common.errors import InvalidArgumentError
from common.wire import decode, encode
from protos.moe_mesh.v1 import tensor_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5), (7,), (2, 3, 4), (0, 64)])
def test_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    msg = encode(t)
    assert list(msg.shape) == list(shape)
    assert len(msg.data) == t.numel() * t.element_size()
    back = decode(tensor_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_non_contiguous_tensors_are_sent_in_logical_order() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()  # [4, 3], not contiguous
    assert torch.equal(decode(encode(t)), t)


def test_decoded_tensors_are_writable_and_do_not_alias_the_message() -> None:
    msg = encode(torch.zeros(2, 2))
    out = decode(msg)
    out += 1  # torch.frombuffer over the message's immutable bytes would fail or alias here
    assert torch.equal(decode(msg), torch.zeros(2, 2))


def test_unsupported_dtypes_are_refused_on_both_sides() -> None:
    with pytest.raises(InvalidArgumentError, match="int64 cannot be sent"):
        encode(torch.zeros(2, dtype=torch.int64))
    msg = encode(torch.zeros(2))
    msg.dtype = tensor_pb2.DTYPE_UNSPECIFIED
    with pytest.raises(InvalidArgumentError) as e:
        decode(msg, "hidden")
    assert str(e.value).startswith("hidden.dtype: unsupported dtype DTYPE_UNSPECIFIED")
    msg.dtype = 99  # a value this build does not know
    with pytest.raises(InvalidArgumentError, match=r"hidden.dtype: unsupported dtype 99"):
        decode(msg, "hidden")


@pytest.mark.parametrize(
    ("shape", "data_bytes", "message"),
    [
        ([2, 3], 20, "output.data: has 20 bytes; shape [2, 3] of DTYPE_FLOAT32 needs 24"),
        ([2, 3], 28, "output.data: has 28 bytes; shape [2, 3] of DTYPE_FLOAT32 needs 24"),
        ([2, -3], 0, "output.shape: negative dimension in [2, -3]"),
    ],
)
def test_malformed_shapes_and_lengths_name_the_field(shape, data_bytes, message) -> None:
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=shape, data=b"\0" * data_bytes)
    with pytest.raises(InvalidArgumentError) as e:
        decode(msg, "output")
    assert str(e.value).startswith(message), str(e.value)
