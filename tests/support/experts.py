"""Expert-service helpers: a request to a host, the reference answer (expert_ffn on independently
loaded weights), decoding and comparing outputs, a channel sized for large tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from common.checkpoint import Checkpoint
from common.moe import expert_ffn
from common.server import channel_options
from common.wire import decode, encode
from expert_service.core import ExpertHost
from expert_service.settings import ExpertSettings
from protos.moe_mesh.v1 import expert_pb2

ARCH = "mixtral"
SPEC = "0-1:0-3"  # layer 2 and experts 4-7 are served elsewhere
HIDDEN = 64
MESSAGE_BYTES = 16 * 1024 * 1024
Groups = list[tuple[int, torch.Tensor]]


def reference(
    path: Path, layer: int, groups: Groups, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """What the service must return: expert_ffn on independently loaded weights, one group at a time."""
    weights = Checkpoint(path, dtype=dtype).load_experts([(layer, e) for e, _ in groups])
    return [expert_ffn(rows, weights[(layer, e)]) for e, rows in groups]


def forward_request(
    host: ExpertHost, layer: int, groups: Groups
) -> expert_pb2.ExpertForwardRequest:
    return expert_pb2.ExpertForwardRequest(
        model_id=host.model_id,
        weights_checksum=host.weights_checksum,
        layer=layer,
        expert_ids=[e for e, _ in groups],
        token_counts=[len(rows) for _, rows in groups],
        hidden=encode(torch.cat([rows for _, rows in groups])),
    )


def decode_output(
    response: expert_pb2.ExpertForwardResponse, counts: list[int]
) -> list[torch.Tensor]:
    return list(torch.split(decode(response.output, "output"), counts))


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = 1e-6) -> None:
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.allclose(g.float(), w.float(), atol=atol, rtol=0), (
            (g - w).abs().max()
        )


def connect(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options(MESSAGE_BYTES))


def expert_settings(checkpoint: Callable[..., Path], **overrides) -> ExpertSettings:
    """Settings of a service for SPEC of the ARCH checkpoint (`checkpoint` is the session fixture)."""
    return ExpertSettings(
        **{"checkpoint": checkpoint(ARCH), "experts": SPEC, "grace_s": 2.0, **overrides}
    )
