"""The one timed streaming HTTP client of the benchmarks (`moe-mesh bench` and bench/): the served model from
`/v1/models`, and streamed completions, each chunk's tokens timed.

`moe-mesh bench`'s requests go to the OpenAI-compatible `/v1/completions` with the prompt as token ids, `ignore_eos`
(the output is exactly `max_tokens` long), greedy sampling, `stream: true` with `return_token_ids`
(each chunk's tokens are counted, not guessed from text) and a final usage chunk.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from common.errors import PreconditionError, UnavailableError
from common.tls import MeshTls
from moe_mesh.benchmark.stats import RequestResult
from moe_mesh.benchmark.workload import BenchRequest
from moe_mesh.ops.client import api_key

CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int


def base_url(url: str) -> str:
    """`http://host:port` from what users paste: with or without the scheme, `/v1` or a trailing slash."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url.removesuffix("/v1")


def session(timeout_s: float, tls: MeshTls | None = None) -> aiohttp.ClientSession:
    """A session with no connection cap (the load generator, not the pool, bounds concurrency),
    checking an https gateway against `tls`'s CA and sending the API key in MOE_MESH_API_KEY."""
    key = api_key()
    context = ssl.create_default_context(cadata=tls.ca.decode()) if tls else True
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=context),
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S),
        headers={"Authorization": f"Bearer {key}"} if key else None,
    )


async def fetch_model(s: aiohttp.ClientSession, url: str) -> ModelInfo:
    """The first model `url` serves. UnavailableError, with a hint, when nothing answers there."""
    try:
        async with s.get(
            f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)
        ) as r:
            r.raise_for_status()
            body = await r.json()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise UnavailableError(
            f"{url}/v1/models: {str(e) or type(e).__name__} (is a gateway serving there? "
            "`moe-mesh up` prints its HTTP address and writes it as gateway_http to --ready-file)"
        ) from None
    try:
        m = body["data"][0]
        return ModelInfo(m["id"], int(m["max_model_len"]), int(m["vocab_size"]))
    except (KeyError, IndexError, TypeError, ValueError):
        raise PreconditionError(
            f"{url}/v1/models names no model with max_model_len and vocab_size: {body!r:.200}"
        ) from None


@dataclass
class Streamed:
    """What one streamed completion sent, and when: seconds from the request's start to its first
    token, the gaps between later chunks with tokens, and to its last token."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage_tokens: int | None = None  # completion_tokens of the final usage chunk
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: str | None = None

    @property
    def max_gap_s(self) -> float:
        """The longest wait for tokens, the first included: how long the stream stalled."""
        return max([self.ttft_s, *self.itl_s]) if self.token_ids else 0.0


async def stream_tokens(
    s: aiohttp.ClientSession, url: str, body: dict, clock: Callable[[], float] = time.perf_counter
) -> Streamed:
    """POST `body` (a streamed /v1/completions request with `return_token_ids`) and time its
    chunks; failures are a result with `error` set, never raised."""
    out = Streamed()
    start = last = clock()
    try:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {_message(await r.text())}"
                return out
            async for line in r.content:
                data = line.strip().removeprefix(b"data:").strip()
                if not data or not line.startswith(b"data:"):
                    continue
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = _message(data.decode())
                    return out
                if chunk.get("usage"):
                    out.usage_tokens = chunk["usage"]["completion_tokens"]
                tokens = [t for c in chunk.get("choices", ()) for t in c.get("token_ids") or ()]
                if tokens:
                    now = clock()
                    if out.token_ids:
                        out.itl_s.append(now - last)
                    else:
                        out.ttft_s = now - start
                    last = now
                    out.token_ids += tokens
                for c in chunk.get("choices", ()):
                    out.finish_reason = c.get("finish_reason") or out.finish_reason
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.latency_s = last - start
    return out


async def stream_completion(
    s: aiohttp.ClientSession, url: str, model: str, req: BenchRequest, t0: float
) -> RequestResult:
    """Send `req` and time its stream; failures are a result with `ok=False`, never raised.
    `t0` (time.perf_counter) is the load point's start, for `start_s`."""
    body = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    result = RequestResult(ok=False, prompt_tokens=req.input_len)
    result.start_s = time.perf_counter() - t0
    streamed = await stream_tokens(s, url, body)
    if streamed.error is not None:
        result.error = streamed.error
        return result
    tokens = len(streamed.token_ids)
    result.ttft_s, result.itl_s, result.latency_s = (
        streamed.ttft_s,
        streamed.itl_s,
        streamed.latency_s,
    )
    result.output_tokens = streamed.usage_tokens if streamed.usage_tokens is not None else tokens
    result.ok = tokens > 0
    if not result.ok:
        result.error = "the stream ended without a token"
    return result


def _message(text: str) -> str:
    """The message of an OpenAI error body, else the text itself (cut short)."""
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]
