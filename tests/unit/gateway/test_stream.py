"""One request stream against scripted routers, a letter tokenizer and a fake clock: stop strings,
failover, the cut-off, metrics and giving the admission place back."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from common.errors import DeadlineExceededError, UnavailableError
from common.resilience import EjectionPolicy, RetryBudget
from common.sampling import SamplingParams
from gateway.balancer import Balancer, RouterLostError
from gateway.router_client import RouterRequest
from gateway.stream import RequestStream, Streaming
from tests.support.fakes import FakeRouter, ScriptedRouter


class Letters:
    """Token t decodes to one letter, so text and stop strings are easy to write down."""

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self) -> None:
        self.values: list[tuple[float, dict | None]] = []

    def record(self, value: float, attributes: dict | None = None) -> None:
        self.values.append((value, attributes))


class Span:
    def __init__(self) -> None:
        self.attributes: dict = {}
        self.events: list[tuple[str, dict]] = []
        self.errors: list[str] = []
        self.ended = 0

    def set_attributes(self, attributes: dict) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str, attributes: dict) -> None:
        self.events.append((name, attributes))

    def record_exception(self, error: Exception) -> None:
        self.errors.append(str(error))

    def set_status(self, *args) -> None:
        pass

    def end(self) -> None:
        self.ended += 1


class Meters:
    def __init__(self) -> None:
        self.duration, self.ttft, self.tpot = Recorder(), Recorder(), Recorder()
        self.spans: list[Span] = []

    def span(self, request):
        self.spans.append(Span())
        return self.spans[-1]


class Released:
    def __init__(self) -> None:
        self.streams: list[RequestStream] = []

    def __call__(self, stream: RequestStream) -> None:
        self.streams.append(stream)


def streaming(routers, clock=None, attempts=3, budget: RetryBudget | None = None) -> Streaming:
    balancer = Balancer(
        EjectionPolicy(consecutive_failures=1, base_ejection_s=1.0),
        budget or RetryBudget(ratio=0.5),
    )
    balancer._turn = -1  # the first pick is routers[0]
    return Streaming(Letters(), balancer, lambda: routers, attempts, Meters(), clock or Clock())


def stream(shared: Streaming, stop=(), deadline=200.0, released=None, **params) -> RequestStream:
    params = {"max_tokens": 6, **params}
    request = RouterRequest("r1", [1, 2, 3], SamplingParams(**params))
    return RequestStream(shared, request, stop, deadline, 100.0, released or Released())


async def drain(s: RequestStream) -> list:
    async with s:
        return [d async for d in s]


async def test_deltas_carry_text_usage_and_the_routers_finish_reason() -> None:
    # ScriptedRouter: the token at absolute position p is 5 + p, so after 3 prompt tokens: 8, 9, ...
    deltas = await drain(stream(streaming([ScriptedRouter("a:1")]), max_tokens=4))
    assert [d.token_ids for d in deltas] == [[8], [9], [10], [11]]
    assert "".join(d.text for d in deltas) == "ijkl"
    assert [d.finish_reason for d in deltas] == [None, None, None, "length"]
    assert [(d.prompt_tokens, d.completion_tokens) for d in deltas] == [
        (3, n) for n in (1, 2, 3, 4)
    ]


async def test_a_stop_string_ends_the_stream_and_the_router_call() -> None:
    router = ScriptedRouter("a:1")
    s = stream(streaming([router]), stop=["kl"], max_tokens=20)
    deltas = await drain(s)
    # "k" is held back (it may start "kl"); at "l" the stop string is complete and cut.
    assert "".join(d.text for d in deltas) == "ij"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].completion_tokens == 4
    assert s.sent == [8, 9, 10, 11] and router.outstanding == 0


async def test_a_stop_string_inside_a_burst_ends_the_tokens_and_usage_at_its_token() -> None:
    class Bursts(ScriptedRouter):  # a router's decode bursts: three tokens a message
        async def generate(self, request, timeout_s, trace_context=None):
            held = []
            async for chunk in super().generate(request, timeout_s, trace_context):
                held.append(chunk)
                if len(held) == 3 or chunk.finish_reason is not None:
                    ids = [t for c in held for t in c.token_ids]
                    yield replace(chunk, token_ids=ids)
                    held = []

    deltas = await drain(stream(streaming([Bursts("a:1")]), stop=["kl"], max_tokens=20))
    # Tokens 8, 9, 10 are "ijk"; the next burst, 11, 12, 13 ("lmn"), completes "kl" at 11.
    assert [d.token_ids for d in deltas] == [[8, 9, 10], [11]]
    assert "".join(d.text for d in deltas) == "ij"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].completion_tokens == 4


async def test_failover_continues_from_the_tokens_sent_with_min_tokens_lowered() -> None:
    dying, healthy = ScriptedRouter("a:1", dies_after=2), ScriptedRouter("b:1")
    shared = streaming([dying, healthy])
    deltas = await drain(stream(shared, max_tokens=6, min_tokens=5, seed=7))
    assert sum((d.token_ids for d in deltas), []) == [8, 9, 10, 11, 12, 13]
    assert [d.completion_tokens for d in deltas] == [1, 2, 3, 4, 5, 6]
    [second] = healthy.calls
    assert second.request_id == "r1~1" and list(second.prompt_token_ids) == [1, 2, 3, 8, 9]
    assert (second.params.max_tokens, second.params.min_tokens, second.params.seed) == (4, 3, 7)
    assert shared.balancer.failovers == 1 and shared.balancer.ejected() == ["a:1"]


async def test_a_router_lost_after_the_last_token_ends_the_stream_with_length() -> None:
    class LostAtTheEnd(ScriptedRouter):
        async def generate(self, request, timeout_s, trace_context=None):
            async for chunk in super().generate(request, timeout_s, trace_context):
                yield replace(chunk, finish_reason=None)
            raise RouterLostError("UNAVAILABLE: Stream removed")

    dying, healthy = LostAtTheEnd("a:1"), ScriptedRouter("b:1")
    deltas = await drain(stream(streaming([dying, healthy]), max_tokens=3))
    assert [d.finish_reason for d in deltas] == [None, None, None, "length"]
    assert deltas[-1].token_ids == [] and deltas[-1].completion_tokens == 3
    assert not healthy.calls  # nothing left to ask it for


async def test_no_retry_without_budget_and_none_past_the_deadline() -> None:
    dead, healthy = ScriptedRouter("a:1", refuses=True), ScriptedRouter("b:1")
    with pytest.raises(UnavailableError, match=r"no router replica could serve it \(1 tried"):
        await drain(
            stream(streaming([dead, healthy], budget=RetryBudget(ratio=0.0, min_per_s=0.0)))
        )
    assert not healthy.calls
    clock = Clock()
    s = stream(streaming([ScriptedRouter("a:1")], clock), deadline=clock.now)
    with pytest.raises(DeadlineExceededError, match="passed its deadline before reaching a router"):
        await drain(s)


async def test_cut_while_waiting_for_the_router_raises_the_cut_error() -> None:
    gate = asyncio.Event()  # never opens
    router = FakeRouter("a:1", gate)
    released = Released()
    s = stream(streaming([router]), released=released)
    reader = asyncio.create_task(drain(s))
    while router.outstanding == 0:
        await asyncio.sleep(0)
    s.cut(UnavailableError("going away"))
    s.cut(UnavailableError("a second cut changes nothing"))
    with pytest.raises(UnavailableError, match="going away"):
        await reader
    assert router.outstanding == 0 and released.streams == [s]


async def test_cut_between_deltas_fails_the_next_step_and_a_client_cancel_stays_a_cancel() -> None:
    s = stream(streaming([ScriptedRouter("a:1")]))
    async with s:
        assert (await anext(aiter(s))).token_ids == [8]
        s.cut(UnavailableError("going away"))
        with pytest.raises(UnavailableError, match="going away"):
            await anext(aiter(s))
    router = FakeRouter("a:1", asyncio.Event())
    s = stream(streaming([router]))
    reader = asyncio.create_task(drain(s))
    while router.outstanding == 0:
        await asyncio.sleep(0)
    reader.cancel()  # the client left just as the cut came
    s.cut(UnavailableError("going away"))
    with pytest.raises(asyncio.CancelledError):
        await reader


async def test_metrics_use_the_clock_and_the_status_the_stream_ended_with() -> None:
    clock = Clock()

    class Ticking(ScriptedRouter):
        async def generate(self, request, timeout_s, trace_context=None):
            async for chunk in super().generate(request, timeout_s, trace_context):
                clock.now += 0.5  # each token half a second after the previous one
                yield chunk

    shared = streaming([Ticking("a:1")], clock)
    await drain(stream(shared, max_tokens=5))
    meters = shared.meters
    assert meters.ttft.values == [(0.5, None)]
    assert meters.tpot.values == [(0.5, None)]  # (2.5 s - 0.5 s) / 4 gaps
    assert meters.duration.values == [(2.5, {"rpc.grpc.status_code": "OK"})]
    failing = streaming([ScriptedRouter("a:1", refuses=True)], clock, attempts=1)
    with pytest.raises(UnavailableError):
        await drain(stream(failing))
    assert failing.meters.duration.values == [
        (clock.now - 100.0, {"rpc.grpc.status_code": "UNAVAILABLE"})
    ]
    assert failing.meters.ttft.values == []


async def test_closing_early_ends_the_router_call_and_gives_the_place_back_once() -> None:
    released, router = Released(), ScriptedRouter("a:1")
    s = stream(streaming([router]), released=released)
    assert (await anext(aiter(s))).token_ids == [8]
    assert router.outstanding == 1
    await s.aclose()
    await s.aclose()
    assert released.streams == [s] and router.outstanding == 0
    with pytest.raises(StopAsyncIteration):
        await anext(aiter(s))


async def test_the_span_starts_when_read_and_records_failover_usage_and_errors() -> None:
    dying, healthy = ScriptedRouter("a:1", dies_after=2), ScriptedRouter("b:1")
    shared = streaming([dying, healthy])
    s = stream(shared, max_tokens=4)
    await s.aclose()  # never read: no span
    assert shared.meters.spans == []
    await drain(stream(shared, max_tokens=4))
    [span] = shared.meters.spans
    assert span.events == [
        ("moe.gateway.failover", {"moe.router.attempt": 1, "moe.tokens_sent": 2})
    ]
    assert span.attributes == {
        "gen_ai.usage.output_tokens": 4,
        "gen_ai.response.finish_reasons": ["length"],
    }
    assert span.ended == 1 and span.errors == []
    failing = streaming([ScriptedRouter("a:1", refuses=True)], attempts=1)
    with pytest.raises(UnavailableError):
        await drain(stream(failing))
    [span] = failing.meters.spans
    assert span.ended == 1 and "no router replica could serve it" in span.errors[0]
