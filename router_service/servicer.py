"""gRPC RouterService: converts protobuf to the core's types and back, nothing else."""

from __future__ import annotations

import time
import uuid

import grpc

from common.errors import MoeMeshError
from common.finish_reason import to_wire
from common.placement import format_experts
from common.sampling import from_proto
from common.status import abort_with
from common.telemetry import OFF, Telemetry
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc, types_pb2
from router_service.core import RouterCore


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, core: RouterCore, telemetry: Telemetry = OFF) -> None:
        self.core = core
        self.errors = telemetry.errors()

    async def Generate(
        self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
    ):
        params = from_proto(request.params)  # the engine checks it (SamplingParams.validate)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            async for out in self.core.generate(
                request.request_id or uuid.uuid4().hex,
                list(request.prompt_token_ids),
                params,
                request.priority,
                deadline,
            ):
                yield router_pb2.RouterGenerateResponse(
                    token_ids=out.new_token_ids,
                    finish_reason=to_wire(out.finish_reason),
                    prompt_tokens=out.prompt_tokens,
                    completion_tokens=out.completion_tokens,
                    logprobs=[
                        types_pb2.TokenLogprobs(
                            logprob=t.logprob,
                            top=[types_pb2.TopLogprob(token_id=i, logprob=v) for i, v in t.top],
                        )
                        for t in out.logprobs or ()
                    ],
                )
        except MoeMeshError as e:
            await abort_with(context, e, self.errors)

    async def Status(
        self, request: router_pb2.RouterStatusRequest, context: grpc.aio.ServicerContext
    ):
        st = self.core.status()
        t = st.tiering
        return router_pb2.RouterStatus(
            model_id=st.model_id,
            architecture=st.architecture,
            vocab_size=st.vocab_size,
            max_model_len=st.max_model_len,
            running=st.running,
            waiting=st.waiting,
            steps=st.steps,
            num_layers=st.num_layers,
            num_experts=st.num_experts,
            tokens_routed=[n for row in st.tokens_routed for n in row],
            failovers=st.failovers,
            placement=[
                router_pb2.ExpertPlacement(
                    backend=b,
                    experts=format_experts(pairs),
                    region=st.regions[b],
                    precision=st.precisions.get(b, ""),
                )
                for b, pairs in st.placement.items()
            ],
            registry_stale=st.registry_stale,
            utilization=[n for row in st.utilization for n in row],
            utilization_window_s=st.window_s,
            region=st.region,
            expert_bytes=t.expert_bytes,
            colocated_bytes=t.colocated_bytes,
            colocate_budget_bytes=t.budget_bytes,
            promotions=t.promotions,
            demotions=t.demotions,
            pinned_hot=format_experts(t.pinned_hot),
            pinned_remote=format_experts(t.pinned_remote),
            moe_layers=st.moe_layers,
            remote_calls=st.remote_calls,
            tokens_colocated=st.tokens_colocated,
            hedges=st.hedges,
            ejections=st.ejections,
            replicas=[
                router_pb2.ExpertReplica(
                    backend=r.backend,
                    transport=r.transport,
                    fast_path=r.fast_path,
                    fast_path_calls=r.fast_path_calls,
                    fast_path_fallbacks=sum(r.fallbacks.values()),
                    fallback_causes=r.fallbacks,
                )
                for r in st.replicas
            ],
            micro_batches_setting=st.pipeline.setting,
            micro_batches=st.pipeline.micro_batches,
            ta_ms=st.pipeline.ta_ms,
            te_ms=st.pipeline.te_ms,
            tc_ms=st.pipeline.tc_ms,
            kv_block_size=st.kv.block_size,
            kv_blocks_total=st.kv.blocks_total,
            kv_blocks_used=st.kv.blocks_used,
            kv_blocks_cached=st.kv.blocks_cached,
            prefix_cache_query_tokens=st.kv.prefix_query_tokens,
            prefix_cache_hit_tokens=st.kv.prefix_hit_tokens,
            preemptions=st.kv.preemptions,
        )
