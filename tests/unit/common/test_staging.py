"""Stager: host <-> device staging, on the CPU (the identity) and on a fake device that keeps
the contract a GPU does: copies are only enqueued, a result is there after the synchronize."""

from __future__ import annotations

import pytest
import torch

from common.staging import MIN_PINNED_BYTES, CudaOps, Stager
from tests.support.devices import FakeDevice


def job(stager: Stager, groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """What the expert batcher does with a job: in, an FFN stand-in per batch, out."""
    xs = stager.to_device(groups)
    return stager.to_host([x * 2 + 1 for x in xs])


def test_on_the_cpu_nothing_is_copied() -> None:
    stager = Stager(torch.device("cpu"))
    assert stager.identity
    one, two = torch.randn(3, 8), torch.randn(2, 8)
    [x] = stager.to_device([[one]])
    assert x is one  # one part: the tensor itself
    [joined] = stager.to_device([[one, two]])
    assert torch.equal(joined, torch.cat([one, two]))
    outs = [torch.randn(4, 8)]
    assert stager.to_host(outs)[0] is outs[0]


def test_a_job_is_one_copy_in_one_copy_out_per_output_and_one_sync() -> None:
    device = FakeDevice()
    stager = Stager(torch.device("cuda"), device)
    a, b, c = torch.randn(3, 8), torch.randn(2, 8), torch.randn(5, 8)
    outs = job(stager, [[a, b], [c]])
    assert [o.shape for o in outs] == [(5, 8), (5, 8)]
    assert torch.equal(outs[0], torch.cat([a, b]) * 2 + 1)
    assert torch.equal(outs[1], c * 2 + 1)
    assert [e[0] for e in device.log] == ["h2d", "d2h", "d2h", "sync"]
    assert device.log[1][1:] == ((5, 8), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_odd_widths_keep_their_values(dtype) -> None:
    device = FakeDevice()
    stager = Stager(torch.device("cuda:1"), device)
    groups = [
        [torch.randn(1, 7).to(dtype)],
        [torch.randn(3, 7).to(dtype), torch.randn(1, 7).to(dtype)],
    ]
    xs = stager.to_device(groups)
    assert [x.dtype for x in xs] == [dtype, dtype]
    assert torch.equal(xs[1], torch.cat(groups[1]))
    outs = stager.to_host(xs)
    assert all(o.dtype == dtype for o in outs)
    assert torch.equal(outs[0], groups[0][0]) and torch.equal(outs[1], torch.cat(groups[1]))


def test_results_belong_to_the_caller_once_the_next_job_reuses_the_buffers() -> None:
    device = FakeDevice()
    stager = Stager(torch.device("cuda"), device)
    first = job(stager, [[torch.ones(4, 8)]])
    second = job(stager, [[torch.zeros(4, 8)]])
    assert torch.equal(first[0], torch.full((4, 8), 3.0))  # not overwritten by the second job
    assert torch.equal(second[0], torch.ones(4, 8))
    assert len(device.buffers) == 2  # one per direction, reused


def test_buffers_grow_on_demand_and_are_kept() -> None:
    device = FakeDevice()
    stager = Stager(torch.device("cuda"), device)
    job(stager, [[torch.randn(2, 8)]])
    assert [b.numel() for b in device.buffers] == [MIN_PINNED_BYTES] * 2
    rows = MIN_PINNED_BYTES // (8 * 4) + 1  # one row more than the first buffers hold
    big = torch.randn(rows, 8)
    [out] = job(stager, [[big]])
    assert torch.equal(out, big * 2 + 1)
    assert len(device.buffers) == 4 and device.buffers[2].numel() >= rows * 8 * 4
    job(stager, [[torch.randn(3, 8)]])
    assert len(device.buffers) == 4  # smaller jobs keep the grown buffers


def test_inputs_of_a_job_without_outputs_are_waited_for_before_the_buffer_is_reused() -> None:
    device = FakeDevice()
    stager = Stager(torch.device("cuda"), device)
    stager.to_device([[torch.ones(2, 8)]])  # every batch failed: no to_host, no sync
    job(stager, [[torch.zeros(2, 8)]])  # the fake asserts the first input was not overwritten
    assert device.count("sync") == 2


def test_an_empty_job_and_empty_groups() -> None:
    stager = Stager(torch.device("cuda"), FakeDevice())
    assert stager.to_host([]) == []
    [x] = stager.to_device([[torch.empty(0, 8)]])
    assert x.shape == (0, 8)


def test_parts_that_cannot_be_joined_are_refused() -> None:
    stager = Stager(torch.device("cuda"), FakeDevice())
    with pytest.raises(ValueError, match="parts to join differ"):
        stager.to_device([[torch.randn(2, 8), torch.randn(2, 4)]])


def test_a_gpu_stager_uses_cuda_ops() -> None:
    assert isinstance(Stager(torch.device("cuda", 0)).ops, CudaOps)  # constructing copies nothing


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: real pinned memory and streams"
)
def test_on_a_real_gpu_outputs_come_back_to_host_memory() -> None:
    stager = Stager(torch.device("cuda"))
    rows = [torch.randn(5, 64), torch.randn(3, 64)]
    xs = stager.to_device([rows[:1], rows[1:]])
    assert all(x.is_cuda for x in xs)
    outs = stager.to_host([x * 2 for x in xs])
    assert all(o.device.type == "cpu" for o in outs)
    assert torch.equal(outs[0], rows[0] * 2) and torch.equal(outs[1], rows[1] * 2)
