"""Fast-path peers for tests: a service that speaks the previous frame version."""

from __future__ import annotations

import numpy as np
import pytest

from common.fastpath import frame as f
from common.fastpath import server as server_module


def speak_previous_frame_version(monkeypatch: pytest.MonkeyPatch) -> int:
    """FrameServers started after this speak the previous frame version: they refuse every frame
    of ours, in their own version, as an older service would. Returns that version."""
    old_version = f.VERSION - 1

    async def refuse(*args, **kwargs):
        raise f.VersionError(f.VERSION)

    def encode_frame(header, payload=None):
        return [np.frombuffer(f.encode_header(header, version=old_version), np.uint8)]

    monkeypatch.setattr(server_module, "read_frame", refuse)
    monkeypatch.setattr(server_module, "encode_frame", encode_frame)
    return old_version
