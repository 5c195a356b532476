"""Where a process computes: `--device {auto,cpu,cuda,cuda:N}`.

Settings models validate the text without torch (`check`), so a mistyped flag is refused before
a service imports it; the service then resolves it (`resolve`): `auto` is the first CUDA device
where torch sees one, else the CPU. A CUDA device asked for on a host without one is an error
naming the flag, not a silent fall back to the CPU: a plan that put a group on a GPU expects it
there.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator

from common.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

CHOICES = "auto, cpu, cuda or cuda:N"
HELP = "where to compute: auto (a GPU where torch sees one, else the CPU), cpu, cuda or cuda:N"
_FORM = re.compile(r"auto|cpu|cuda(:\d{1,2})?")


def check(text: str) -> str:
    """`text` as a device name, lower-cased; ValueError naming the choices otherwise."""
    value = text.strip().lower()
    if not _FORM.fullmatch(value):
        raise ValueError(f"device must be {CHOICES}, got {text!r}")
    return value


# A settings field's type: `device: DeviceName = Field("auto", description=HELP)`.
DeviceName = Annotated[str, AfterValidator(check)]


def for_experts(text: str, quantized: bool) -> str:
    """The device quantized or plain experts compute on: quantized ones run on CPUs only, so
    `auto` is then the CPU (a GPU named stays named, for the error that refuses it)."""
    return "cpu" if quantized and text == "auto" else text


def is_cuda(text: str) -> bool:
    """Whether a checked device name asks for a GPU by name (`auto` does not: it may be none)."""
    return text.startswith("cuda")


def resolve(text: str, field: str = "device") -> torch.device:
    """The torch device `text` names on this host: InvalidArgumentError naming `field` where it
    is a GPU torch cannot see here."""
    import torch

    value = check(text)
    if value == "cpu" or (value == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if value == "auto":
        return torch.device("cuda", torch.cuda.current_device())
    if not torch.cuda.is_available():
        raise InvalidArgumentError(
            field,
            f"{value!r} asked, but torch sees no CUDA device here (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}); use cpu or auto",
        )
    device = torch.device(value)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise InvalidArgumentError(
            field,
            f"{value!r} asked, but this host has {torch.cuda.device_count()} CUDA device(s): "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}",
        )
    return torch.device("cuda", index)


def free_bytes(device: torch.device) -> int | None:
    """Bytes free on a GPU now (what the KV cache is sized from there); None on the CPU."""
    import torch

    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def device_lost(error: BaseException) -> bool:
    """Whether `error` leaves this process's device unusable. A CUDA error (a device-side assert,
    an illegal address) outlives the call that raised it: every later call on the device fails
    too, and only a new process recovers (vLLM's engine dies on one likewise). Running out of
    device memory is not one (torch.OutOfMemoryError): the next, smaller step may fit. A library
    call on a device already lost may raise a plain RuntimeError saying "CUDA error:" (cuBLAS's
    CUBLAS_STATUS_EXECUTION_FAILED): one too."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return False
    return isinstance(error, torch.AcceleratorError) or (
        isinstance(error, RuntimeError) and "CUDA error:" in str(error)
    )
