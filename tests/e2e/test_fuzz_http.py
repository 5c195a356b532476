"""Property-based fuzzing of the OpenAI-compatible HTTP API from its own OpenAPI schema (schemathesis
on hypothesis), plus hostile values the schema does not suggest. No input may get a 5xx or hurt
the service: afterwards it still answers a greedy request with the right tokens.

A small budget here (`make test`); bench/chaos.py runs the same generator for >= 10,000 cases.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from tests.support.meshes import local_mesh
from tests.support.reference import PROMPTS, monolithic

EXAMPLES = 25  # per operation and mode


def _each(strategy: st.SearchStrategy, send, examples: int) -> None:
    """Call `send` on `examples` generated values (derandomized: the same cases every run)."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(value=strategy)
    def check(value) -> None:
        send(value)

    check()


def _send_case(base_url: str, failures: list[str], label: str, case) -> None:
    if case.body is not None and isinstance(case.body, dict):
        case.body.setdefault("max_tokens", 2)  # keep the valid ones short
    response = case.call(base_url=base_url, timeout=30)
    if response.status_code >= 500:
        failures.append(
            f"{label}: {response.status_code} {response.text[:200]} "
            f"for {json.dumps(case.body, default=str)[:300]}"
        )


def fuzz_schema(base_url: str, examples: int) -> list[str]:
    """Run schemathesis' generated cases (valid and invalid) against every operation; the failures."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            send = partial(_send_case, base_url, failures, f"{operation.label} {mode.name}")
            try:
                _each(operation.as_strategy(generation_mode=mode), send, examples)
            except Unsatisfiable:  # e.g. no invalid request exists for GET /v1/models
                assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
    return failures


HOSTILE = st.one_of(
    st.text(
        alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3
    ),
    st.sampled_from([float("nan"), float("inf"), -1e308, 2**64, -(2**63), 0, -1]),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=5),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=20,
    ),
)
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "stream",
    "request_id",
    "model",
    "priority",
    "ignore_eos",
]


def fuzz_hostile(base_url: str, examples: int) -> list[str]:
    """Bodies with one or more fields set to hostile values (surrogates, NaN, huge ints, deep nesting)."""
    failures: list[str] = []
    bodies = st.tuples(
        st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        st.dictionaries(st.sampled_from(FIELDS), HOSTILE, min_size=1, max_size=4),
    )
    with httpx.Client(base_url=base_url, timeout=30) as client:

        def send(path_and_body) -> None:
            path, body = path_and_body
            body.setdefault("max_tokens", 2)
            # json.dumps writes lone surrogates as \ud800 escapes, as a hostile client would.
            response = client.post(
                path,
                content=json.dumps(body, allow_nan=True),
                headers={"content-type": "application/json"},
            )
            if response.status_code >= 500:
                failures.append(
                    f"{path}: {response.status_code} {response.text[:200]} for {body!r:.300}"
                )

        _each(bodies, send, examples)
    return failures


@pytest.mark.timeout(240)
async def test_generated_and_hostile_bodies_never_get_a_5xx_and_the_service_stays_correct(
    checkpoint,
) -> None:
    path = checkpoint("mixtral")
    async with local_mesh(path) as mesh:
        base = mesh.http_base_url
        # The generators are synchronous clients: on threads, so this loop keeps serving them.
        failures = await asyncio.to_thread(fuzz_schema, base, EXAMPLES)
        failures += await asyncio.to_thread(fuzz_hostile, base, EXAMPLES * 4)
        assert failures == [], "\n".join(failures[:10])
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            assert (await client.get("/health/ready")).status_code == 200
            reply = await client.post(
                "/v1/completions",
                json={
                    "prompt": PROMPTS[1],
                    "max_tokens": 32,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert (
            tuple(choice["token_ids"]) == monolithic(path)[1]
            and choice["finish_reason"] == "length"
        )
