"""moe_mesh.v1.ExpertService over gRPC: converts protobuf <-> tensors and errors -> statuses, nothing else."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from common import wire
from common.errors import MoeMeshError
from common.status import abort_with
from common.telemetry import OFF, Telemetry
from expert_service.core import ExpertHost
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc, tensor_pb2


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    """Thin adapter from the generated service to an ExpertHost."""

    def __init__(
        self,
        host: ExpertHost,
        telemetry: Telemetry = OFF,
        fast_paths: Callable[[], list[str]] = list,
        max_message_bytes: int = 0,
    ) -> None:
        self.host = host
        self.fast_paths = fast_paths  # known once the app started its fast path
        self.max_message_bytes = max_message_bytes
        self.errors = telemetry.errors()

    async def Forward(
        self, request: expert_pb2.ExpertForwardRequest, context: grpc.aio.ServicerContext
    ) -> expert_pb2.ExpertForwardResponse:
        try:
            began = time.perf_counter()
            hidden = wire.decode(request.hidden, "hidden")
            output = await self.host.forward(
                request.model_id,
                request.weights_checksum,
                request.layer,
                list(request.expert_ids),
                list(request.token_counts),
                hidden,
            )
            return expert_pb2.ExpertForwardResponse(
                output=wire.encode(output), service_seconds=time.perf_counter() - began
            )
        except MoeMeshError as e:
            await abort_with(context, e, self.errors)
            raise  # unreachable: abort raises; keeps type checkers honest

    async def Describe(
        self, request: expert_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> expert_pb2.DescribeResponse:
        try:
            self.host.check_serving()
        except MoeMeshError as e:
            await abort_with(context, e, self.errors)
            raise  # unreachable: abort raises; keeps type checkers honest
        d = self.host.describe()
        return expert_pb2.DescribeResponse(
            model_id=d.model_id,
            weights_checksum=d.weights_checksum,
            experts=[
                tensor_pb2.ExpertKey(layer=layer, expert=expert) for layer, expert in d.experts
            ],
            dtype=wire.TO_WIRE[d.dtype],
            hidden_size=d.hidden_size,
            region=d.region,
            precision=d.precision,
            device=d.device,
            stats=expert_pb2.ExpertStats(
                forward_calls=d.stats.forward_calls,
                groups=d.stats.groups,
                batches=d.stats.batches,
                tokens=d.stats.tokens,
            ),
            fast_paths=self.fast_paths(),
            max_message_bytes=self.max_message_bytes,
        )
