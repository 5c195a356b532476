"""expert_service/fastpath.py: request frames reach the same ExpertHost.forward as gRPC calls, with
the frame's fields as its arguments; off, or without UCX in auto mode, nothing is served or
advertised, while a service asked for UCX that cannot have it refuses to start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.errors import PreconditionError
from common.fastpath import frame as f
from common.fastpath import parse_worker_url, ucx
from common.fastpath.client import FrameClient
from common.telemetry import OFF
from expert_service import fastpath as fastpath_module
from expert_service.fastpath import FastPath

MESSAGE_BYTES = 1 << 20


class ScriptedHost:
    """An ExpertHost's face to the fast path: settings, telemetry, and a forward that doubles."""

    def __init__(self, mode: str) -> None:
        self.settings = SimpleNamespace(
            fast_path=mode, max_message_bytes=MESSAGE_BYTES, host="127.0.0.1"
        )
        self.telemetry = OFF
        self.calls: list[tuple] = []

    async def forward(self, model_id, checksum, layer, expert_ids, token_counts, hidden):
        self.calls.append((model_id, checksum, layer, expert_ids, token_counts, hidden))
        return hidden * 2


HEADER = f.RequestHeader("m", "sha256:abc", 2, [3, 1], [1, 1], "float32", [2, 4], 32)


async def test_a_frame_is_forwarded_with_its_fields_and_an_empty_payload_as_its_shape() -> None:
    host = ScriptedHost("auto")
    x = torch.randn(2, 4)
    assert torch.equal(await FastPath(host).forward(HEADER, x), x * 2)
    await FastPath(host).forward(HEADER, None)
    (*args, hidden), (*_, empty) = host.calls
    assert args == ["m", "sha256:abc", 2, [3, 1], [1, 1]] and hidden is x
    assert empty.shape == (2, 4) and empty.dtype == torch.float32


async def test_off_serves_and_advertises_nothing() -> None:
    fast = FastPath(ScriptedHost("off"))
    assert fast.server is None and await fast.start() == []
    await fast.stop()


async def test_without_ucx_auto_turns_it_off_and_ucx_refuses_to_start(monkeypatch) -> None:
    monkeypatch.setattr(fastpath_module, "load_ucxx", lambda loopback: None)
    auto = FastPath(ScriptedHost("auto"))
    assert await auto.start() == [] and auto.server is None
    with pytest.raises(PreconditionError, match="--fast-path ucx"):
        await FastPath(ScriptedHost("ucx")).start()


@pytest.mark.skipif(
    ucx.load_ucxx(loopback=True) is None, reason=f"UCX fast path unavailable: {ucx.unavailable}"
)
async def test_a_call_over_ucx_reaches_the_host() -> None:
    host = ScriptedHost("ucx")
    fast = FastPath(host)
    [url] = await fast.start()
    client = FrameClient(parse_worker_url(url), MESSAGE_BYTES)
    try:
        x = torch.randn(2, 4)
        out, _ = await client.call(HEADER, x, 30.0)
        assert torch.equal(out, x * 2) and len(host.calls) == 1
        assert torch.equal(host.calls[0][-1], x)
    finally:
        client.close()
        await fast.stop()
