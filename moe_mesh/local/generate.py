"""In-process generation: the monolithic engine plus tokenization, streaming text and stop strings."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.sampling import SamplingParams
from common.tokenizer import TextStream, Tokenizer
from router_service.engine.engine import Engine, FinishReason


@dataclass
class LocalRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    time_to_first_token_s: float = 0.0
    latency_s: float = 0.0
    logprobs: list[dict] | None = None  # {"logprob", "top": [[token id, logprob], ...]} per token

    def to_json(self) -> dict:
        n = len(self.token_ids)
        decode_s = self.latency_s - self.time_to_first_token_s
        return {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": len(self.prompt_token_ids),
                "completion_tokens": n,
                "total_tokens": len(self.prompt_token_ids) + n,
            },
            "latency_s": round(self.latency_s, 4),
            "time_to_first_token_s": round(self.time_to_first_token_s, 4),
            "decode_tokens_per_s": round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else None,
            **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
        }


async def generate_local(
    engine: Engine,
    tokenizer: Tokenizer,
    requests: list[LocalRequest],
    on_text: Callable[[str, str], None] | None = None,
) -> list[GenerationResult]:
    """Run requests to completion on the engine; `on_text(request_id, delta)` receives streamed text."""
    start = time.perf_counter()
    results = {r.request_id: GenerationResult(r.request_id, r.prompt_token_ids) for r in requests}
    streams = {r.request_id: TextStream(tokenizer, r.stop) for r in requests}
    for r in requests:
        engine.add_request(r.request_id, r.prompt_token_ids, r.params)

    def emit(rid: str, delta: str) -> None:
        results[rid].text += delta
        if delta and on_text is not None:
            on_text(rid, delta)

    while engine.has_unfinished():
        for out in await engine.step():
            res, stream = results[out.request_id], streams[out.request_id]
            if res.finish_reason is not None:  # already ended by a stop string
                continue
            if not res.token_ids and out.new_token_ids:
                res.time_to_first_token_s = time.perf_counter() - start
            text, taken = stream.take(out.new_token_ids)  # a burst's tokens end at a stop string
            res.token_ids += out.new_token_ids[:taken]
            if out.logprobs is not None:
                res.logprobs = (res.logprobs or []) + [
                    {"logprob": t.logprob, "top": [list(a) for a in t.top]}
                    for t in out.logprobs[:taken]
                ]
            emit(out.request_id, text)
            if stream.stopped:
                engine.abort(out.request_id)
                res.finish_reason = FinishReason.STOP.value
            elif out.finish_reason is not None:
                emit(out.request_id, stream.finish())
                res.finish_reason = out.finish_reason.value
            if res.finish_reason is not None:
                res.latency_s = time.perf_counter() - start
    return [results[r.request_id] for r in requests]
