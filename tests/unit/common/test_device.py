"""`--device` (common/device.py): names checked without torch, resolved on this host, and a GPU
asked for where torch sees none refused naming the field; which errors leave the device lost."""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, ValidationError

from common import device as devices
from common.errors import InvalidArgumentError


class Settings(BaseModel):
    device: devices.DeviceName = "auto"


@pytest.mark.parametrize("text", ["auto", "cpu", "cuda", "cuda:0", "CUDA:3", " cpu "])
def test_device_names_are_taken_lower_cased(text):
    assert Settings(device=text).device == text.strip().lower()


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "cuda:100", "mps", ""])
def test_other_names_are_refused_naming_the_choices(text):
    with pytest.raises(ValidationError, match="auto, cpu, cuda or cuda:N"):
        Settings(device=text)


def test_cpu_and_auto_resolve_to_the_cpu_without_a_gpu():
    assert devices.resolve("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert devices.resolve("auto") == torch.device("cpu")
        assert devices.free_bytes(torch.device("cpu")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
@pytest.mark.parametrize("text", ["cuda", "cuda:1"])
def test_a_gpu_asked_for_where_there_is_none_is_an_error_naming_the_field(text):
    with pytest.raises(InvalidArgumentError, match="^device: .*no CUDA device") as e:
        devices.resolve(text)
    assert e.value.field == "device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: none here")
def test_gpus_resolve_by_index_and_one_past_the_last_is_refused():
    assert devices.resolve("cuda") == torch.device("cuda", torch.cuda.current_device())
    assert devices.free_bytes(devices.resolve("cuda:0")) > 0
    with pytest.raises(InvalidArgumentError, match="CUDA device"):
        devices.resolve(f"cuda:{torch.cuda.device_count()}")


def test_which_errors_leave_the_device_lost() -> None:
    assert devices.device_lost(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    # cuBLAS on a device already lost raises a plain RuntimeError
    assert devices.device_lost(RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when"))
    assert not devices.device_lost(torch.OutOfMemoryError("CUDA out of memory"))  # may fit later
    assert not devices.device_lost(RuntimeError("a bug"))
