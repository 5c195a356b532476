"""gRPC moe_mesh.v1.Inference: converts protobuf to the core's types and back, nothing else."""

from __future__ import annotations

import logging
from dataclasses import replace

import grpc

from common.errors import MoeMeshError
from common.finish_reason import to_wire
from common.sampling import SamplingParams, from_proto
from common.status import abort_with
from gateway.auth import Caller
from gateway.core import GatewayCore, TextRequest
from gateway.router_client import Logprobs
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc, types_pb2

log = logging.getLogger(__name__)


def _request(msg: inference_pb2.GenerateRequest) -> TextRequest:
    # Sampling fields by name; logprobs is a flag here, with the count in top_logprobs.
    logprobs = msg.top_logprobs if msg.logprobs else None
    return TextRequest(
        model=msg.model,
        prompt=msg.prompt if msg.HasField("prompt") else None,
        prompt_token_ids=msg.prompt_token_ids or None,
        params=from_proto(msg, SamplingParams(max_tokens=None), logprobs=logprobs),
        stop=msg.stop,
        priority=msg.priority,
        request_id=msg.request_id,
        names={"logprobs": "top_logprobs"},
    )


def _logprobs(logprobs: list[Logprobs] | None) -> list[types_pb2.TokenLogprobs]:
    return [
        types_pb2.TokenLogprobs(
            logprob=lp, top=[types_pb2.TopLogprob(token_id=i, logprob=v) for i, v in top]
        )
        for lp, top in logprobs or ()
    ]


def _usage(prompt: int, completion: int) -> inference_pb2.Usage:
    return inference_pb2.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The API key from `authorization: Bearer <key>` metadata, as on HTTP."""
        metadata = dict(context.invocation_metadata() or ())
        return self.core.authenticate(metadata.get("authorization"))

    def _admitted(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> TextRequest:
        """The request as its API key lets it run (Caller.admit); priority 0 is proto3's unset."""
        r = _request(request)
        return replace(r, priority=self._caller(context).admit(request.priority or None))

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        try:
            c = await self.core.complete(self._admitted(request, context), context.time_remaining())
        except MoeMeshError as e:
            log.info("request %s failed: %s", request.request_id or "-", e)
            self.core.count_failure(e)  # here, where it becomes the answer: once per request
            await abort_with(context, e)
        log.info(
            "request %s finished: %s, %d tokens", c.request_id, c.finish_reason, c.completion_tokens
        )
        return inference_pb2.GenerateResponse(
            request_id=c.request_id,
            token_ids=c.token_ids,
            text=c.text,
            finish_reason=to_wire(c.finish_reason),
            usage=_usage(c.prompt_tokens, c.completion_tokens),
            logprobs=_logprobs(c.logprobs),
        )

    async def GenerateStream(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        try:
            r = self._admitted(request, context)
            async with await self.core.start(r, context.time_remaining()) as gen:
                async for d in gen:
                    last = d.finish_reason is not None
                    yield inference_pb2.GenerateStreamResponse(
                        request_id=d.request_id,
                        token_ids=d.token_ids,
                        text=d.text,
                        finish_reason=to_wire(d.finish_reason),
                        usage=_usage(d.prompt_tokens, d.completion_tokens) if last else None,
                        logprobs=_logprobs(d.logprobs),
                    )
        except MoeMeshError as e:
            log.info("stream %s failed: %s", request.request_id or "-", e)
            self.core.count_failure(e)
            await abort_with(context, e)

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ):
        try:
            self._caller(context)
        except MoeMeshError as e:
            self.core.count_failure(e)
            await abort_with(context, e)
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(
                    id=m.id,
                    architecture=m.architecture,
                    max_model_len=m.max_model_len,
                    vocab_size=m.vocab_size,
                )
                for m in self.core.list_models()
            ]
        )
