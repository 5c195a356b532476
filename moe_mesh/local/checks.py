"""What `moe-mesh up` checks before it starts a process. Of the checkpoint: every check that reads
no tensor data (common/arch/shapes.py), so that a broken checkpoint is a usage error (exit 2)
reported before any process starts (the check itself takes milliseconds), not a service that dies
while loading after the others started. Of a device: a GPU asked for where torch sees none (torch
is imported only then: `up` on the CPU stays quick to start). Of the gateway's address: a warning
on the terminal when it is open to other machines without TLS or API keys (the gateway logs it
too, into its log)."""

from __future__ import annotations

import os
from pathlib import Path

from common.device import is_cuda
from common.errors import CheckpointError, InvalidArgumentError


def checkpoint_problem(checkpoint: Path) -> str | None:
    """The first problem of `checkpoint` as one line naming --checkpoint, the file, the tensor
    and the config field; None when the headers agree with config.json."""
    from common.arch.shapes import check_checkpoint

    try:
        check_checkpoint(checkpoint)
    except CheckpointError as e:
        return f"--checkpoint: {e}"
    return None


def device_problem(flag: str, device: str) -> str | None:
    """A GPU that `flag` names and torch cannot see here, as one line naming `flag`; None for
    cpu and auto (the CPU where there is no GPU) without importing torch."""
    if not is_cuda(device):
        return None
    from common.device import resolve

    try:
        resolve(device, flag)
    except InvalidArgumentError as e:
        return str(e)
    return None


def exposure(host: str | None, tls: bool, api_key_file: Path | None) -> str | None:
    """The gateway's warning (gateway/exposure.py) for the flags `up` passes it."""
    from gateway.auth import ENV_KEYS
    from gateway.exposure import exposure_warning
    from gateway.settings import GatewaySettings

    host = host or GatewaySettings.model_fields["host"].default
    keys = api_key_file is not None or bool(os.environ.get(ENV_KEYS))
    return exposure_warning(host, tls, keys)
