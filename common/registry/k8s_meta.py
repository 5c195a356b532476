"""What a registry's `meta` says of an instance, asked of the instance itself over gRPC.

With Kubernetes discovery the EndpointSlice gives only an address; the meta Consul carries
(experts, model id, weights checksum, region, fast path, ...) comes from the expert service's
Describe RPC, and a router's model id from its Status RPC. So discovery needs no permission on
Pods, and what a replica says is what it serves, not what a manifest claimed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from common.placement import format_experts
from common.registry import EXPERT_SERVICE, ROUTER_SERVICE

# (service, "host:port") -> its meta; {} for services nothing is asked of.
Describer = Callable[[str, str], Awaitable[dict[str, str]]]


def grpc_describer(tls=None, timeout_s: float = 5.0) -> Describer:
    """Ask expert services Describe and routers Status, with the mesh's mutual TLS when on
    (`tls`: a common.tls.MeshTls). Errors propagate (grpc.aio.AioRpcError): the caller retries."""

    async def describe(service: str, endpoint: str) -> dict[str, str]:
        # Imported here: a registry client need not load grpc until it describes something.
        from common.tls import open_channel
        from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc, router_pb2, router_pb2_grpc

        if service not in (EXPERT_SERVICE, ROUTER_SERVICE):
            return {}
        async with open_channel(endpoint, [], tls=tls) as channel:
            if service == ROUTER_SERVICE:
                status = await router_pb2_grpc.RouterServiceStub(channel).Status(
                    router_pb2.RouterStatusRequest(), timeout=timeout_s
                )
                return {"model_id": status.model_id}
            d = await expert_pb2_grpc.ExpertServiceStub(channel).Describe(
                expert_pb2.DescribeRequest(), timeout=timeout_s
            )
        return expert_meta(d)

    return describe


def expert_meta(d) -> dict[str, str]:
    """An expert service's DescribeResponse as the meta it registers with Consul
    (expert_service/app.py: ExpertApp._instance)."""
    from protos.moe_mesh.v1 import tensor_pb2

    dtype = tensor_pb2.DType.Name(d.dtype).removeprefix("DTYPE_").lower()
    return {
        "model_id": d.model_id,
        "weights_checksum": d.weights_checksum,
        "experts": format_experts([(k.layer, k.expert) for k in d.experts]),
        "region": d.region,
        "dtype": dtype,
        "precision": d.precision,
        "device": d.device or "cpu",  # a service older than the field computes on the CPU
        "fast_path": d.fast_paths[0] if d.fast_paths else "",
        "max_message_bytes": str(d.max_message_bytes),
    }
