"""The benchmark's HTTP client: the served model from `/v1/models`, and one streamed completion timed.

Requests go to the OpenAI-compatible `/v1/completions` with the prompt as token ids, `ignore_eos`
(the output is exactly `max_tokens` long), greedy sampling, `stream: true` with `return_token_ids`
(each chunk's tokens are counted, not guessed from text) and a final usage chunk.
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass

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
    start = time.perf_counter()
    result.start_s = start - t0
    last, tokens, usage = start, 0, None
    try:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {_message(await r.text())}"
                return result
            async for line in r.content:
                data = line.strip().removeprefix(b"data:").strip()
                if not data or not line.startswith(b"data:"):
                    continue
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = _message(data.decode())
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if n:
                    now = time.perf_counter()
                    if tokens:
                        result.itl_s.append(now - last)
                    else:
                        result.ttft_s = now - start
                    last, tokens = now, tokens + n
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency_s = last - start
    result.output_tokens = usage if usage is not None else tokens
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
