"""Gateway core against fake router backends: admission by priority, balancing over router replicas,
failover, retries and failure paths."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from common.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from common.resilience import RetryBudget
from common.sampling import SamplingParams
from common.telemetry import Telemetry
from gateway.admission import Admission
from gateway.core import GatewayCore, TextRequest
from tests.support.fakes import FakeRouter, ScriptedRouter, core
from tests.support.metrics import scrape, total
from tests.support.polling import eventually


async def test_requests_spread_over_router_replicas_by_outstanding_streams(checkpoint) -> None:
    gate = asyncio.Event()
    a, b = FakeRouter("a:1", gate), FakeRouter("b:1", gate)
    gw = core(checkpoint("mixtral"), [a, b])
    tasks = [
        asyncio.create_task(
            gw.complete(TextRequest(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=3)))
        )
        for _ in range(6)
    ]
    await eventually(lambda: a.outstanding + b.outstanding == 6, 5, "six streams at the routers")
    assert (a.outstanding, b.outstanding) == (3, 3)  # concurrent streams balance
    gate.set()
    results = await asyncio.gather(*tasks)
    assert all(r.token_ids == [5, 6, 7] and r.finish_reason == "length" for r in results)
    for _ in range(4):  # sequential requests rotate between idle replicas
        await gw.complete(TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=1)))
    assert len(a.served) == len(b.served) == 5


async def test_admission_serves_waiting_requests_by_priority_then_arrival() -> None:
    adm = Admission(max_in_flight=1, max_queued=3, retry_after_s=2.0)
    order: list[str] = []

    async def request(name: str, priority: int) -> None:
        await adm.acquire(priority)
        order.append(name)
        await asyncio.sleep(0.01)
        adm.release()

    first = asyncio.create_task(request("first", 0))
    await asyncio.sleep(0)
    waiting = [
        asyncio.create_task(request(n, p)) for n, p in [("low", -1), ("high", 5), ("normal", 0)]
    ]
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhaustedError, match="retry after 2s") as e:
        await request("rejected", 9)
    assert e.value.retry_after_s == 2.0 and adm.rejected == 1
    await asyncio.gather(first, *waiting)
    assert order == ["first", "high", "normal", "low"]
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    adm = Admission(max_in_flight=1, max_queued=1, retry_after_s=1.0)
    await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    assert adm.queued == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert adm.queued == 0
    adm.release()
    assert adm.in_flight == 0
    await adm.acquire()  # still usable
    assert adm.in_flight == 1


async def test_places_taken_together_never_deadlock_and_the_first_in_line_is_not_overtaken() -> (
    None
):
    adm = Admission(max_in_flight=2, max_queued=4, retry_after_s=1.0)
    await adm.acquire(places=1)
    both = asyncio.create_task(adm.acquire(places=2))  # needs both places: waits, holding none
    await asyncio.sleep(0)
    assert adm.in_flight == 1 and adm.queued == 1
    one = asyncio.create_task(adm.acquire(places=1))  # would fit, but queues behind `both`
    await asyncio.sleep(0)
    assert adm.in_flight == 1 and adm.queued == 2
    adm.release()
    await both
    assert adm.in_flight == 2 and not one.done()
    adm.release(2)
    await one
    assert adm.in_flight == 1 and adm.queued == 0
    # A waiter needing more than is free gives way when it leaves the line.
    big = asyncio.create_task(adm.acquire(places=2))
    small = asyncio.create_task(adm.acquire(places=1))
    await asyncio.sleep(0)
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)
    await asyncio.wait_for(small, 1)
    assert adm.in_flight == 2 and adm.queued == 0
    with pytest.raises(ValueError):
        await adm.acquire(places=3)


# -- failure paths -------------------------------------------------------------------------------


async def collect(
    gw: GatewayCore, r: TextRequest, timeout_s: float | None = None
) -> tuple[list[int], list]:
    async with await gw.start(r, timeout_s) as gen:
        deltas = [d async for d in gen]
    return sum((d.token_ids for d in deltas), []), deltas


async def test_a_stream_cut_by_a_dying_router_continues_on_another_with_the_same_tokens(
    checkpoint,
) -> None:
    path = checkpoint("mixtral")
    undisturbed, _ = await collect(
        core(path, [ScriptedRouter("c:1")]),
        TextRequest(prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=12)),
    )
    dying, healthy = ScriptedRouter("a:1", dies_after=5), ScriptedRouter("b:1")
    gw = core(path, [dying, healthy])
    gw.balancer._turn = -1  # the first pick is `dying`
    r = TextRequest(
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=12, temperature=0.7),
        request_id="r1",
    )
    ids, deltas = await collect(gw, r)
    assert ids == undisturbed and len(ids) == 12
    assert [d.finish_reason for d in deltas] == [None] * 11 + ["length"]
    assert [d.completion_tokens for d in deltas] == list(range(1, 13)) and deltas[
        -1
    ].prompt_tokens == 3
    [first], [second] = dying.calls, healthy.calls
    assert list(second.prompt_token_ids) == [
        1,
        2,
        3,
        *ids[:5],
    ]  # token ids as they were, not re-tokenized
    assert second.params.max_tokens == 7 and second.request_id == "r1~1"
    # temperature > 0 without a seed: the gateway chose one, and the continuation keeps it.
    assert first.params.seed is not None and second.params.seed == first.params.seed
    assert gw.balancer.failovers == 1 and gw.balancer.ejected() == ["a:1"]


async def test_a_refusing_router_is_ejected_and_requests_go_to_the_healthy_one(
    checkpoint, caplog
) -> None:
    dead, healthy = ScriptedRouter("a:1", refuses=True), ScriptedRouter("b:1")
    gw = core(checkpoint("mixtral"), [dead, healthy])
    gw.balancer._turn = -1  # the first pick is `dead`
    with caplog.at_level(logging.WARNING):
        for _ in range(10):
            ids, _ = await collect(
                gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=3))
            )
            assert ids == [6, 7, 8]
    assert len(dead.calls) == 1 and len(healthy.calls) == 10  # ejected after its first failure
    assert gw.balancer.ejections == 1 and gw.balancer.failovers == 1
    [record] = caplog.records  # the operator's clue: which router, for how long, and why
    assert record.getMessage() == (
        "router a:1 ejected for 1s (ejection 1 in a row): "
        "UNAVAILABLE: failed to connect to all addresses"
    )


async def test_an_ejected_router_is_back_once_it_passes_a_check_with_the_gateways_model(
    checkpoint,
) -> None:
    dead, healthy = ScriptedRouter("a:1", refuses=True), ScriptedRouter("b:1")
    gw = core(checkpoint("mixtral"), [dead, healthy], router_ejection_s=30.0)
    gw.balancer._turn = -1  # the first pick is `dead`
    request = TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=3))
    try:
        assert (await collect(gw, request))[0] == [6, 7, 8]  # failed over
        assert gw.balancer.ejected() == ["a:1"]
        await eventually(lambda: dead.checks >= 2, 3, "checks of the ejected router")
        dead.refuses, dead.model = False, "another-model"  # restarted on another checkpoint
        await eventually(lambda: dead.checks >= 4, 3, "more checks")
        assert gw.balancer.ejected() == ["a:1"]  # up, but not serving this gateway's model
        dead.model = "m"
        start, calls = time.monotonic(), len(dead.calls)
        while len(dead.calls) == calls:  # back within about a check interval (0.5 s), not 30 s
            assert time.monotonic() - start < 3.0, "still ejected"
            assert (await collect(gw, request))[0] == [6, 7, 8]
            await asyncio.sleep(0.05)
        assert gw.balancer.ejected() == [] and gw.balancer.health(dead).streak == 0
    finally:
        await gw.balancer.close()


async def test_retries_stop_at_the_budget_and_at_router_attempts(checkpoint) -> None:
    dead, healthy = ScriptedRouter("a:1", refuses=True), ScriptedRouter("b:1")
    gw = core(checkpoint("mixtral"), [dead, healthy])
    gw.balancer.budget = RetryBudget(ratio=0.0, min_per_s=0.0)  # no retry allowed
    gw.balancer._turn = -1
    with pytest.raises(UnavailableError, match="no router replica could serve it") as e:
        await collect(gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=3)))
    assert "a:1" not in str(e.value) and not healthy.calls and gw.balancer.budget.refused == 1

    everyone_dead = [ScriptedRouter(f"d:{i}", refuses=True) for i in range(5)]
    gw = core(checkpoint("mixtral"), everyone_dead, router_attempts=3)
    with pytest.raises(UnavailableError, match=r"\(3 tried"):
        await collect(gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=3)))
    assert sum(len(r.calls) for r in everyone_dead) == 3


async def test_no_router_is_unavailable_and_a_stream_without_finish_reason_is_an_error(
    checkpoint,
) -> None:
    gw = core(checkpoint("mixtral"), [])
    with pytest.raises(UnavailableError, match="no router replica is available"):
        await collect(gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=3)))
    assert gw.admission.in_flight == 0

    silent = ScriptedRouter("a:1", no_finish=True)
    gw = core(checkpoint("mixtral"), [silent])
    with pytest.raises(UnavailableError, match="without a finish reason"):
        await collect(gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=3)))
    assert len(silent.calls) == 1  # not retried: the router answered, wrongly
    assert gw.admission.in_flight == 0


async def test_waiting_for_admission_ends_at_the_deadline(checkpoint) -> None:
    gate = asyncio.Event()
    gw = core(checkpoint("mixtral"), [FakeRouter("a:1", gate)], max_in_flight=1, max_queued=4)
    holder = asyncio.create_task(
        collect(gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2)))
    )
    await eventually(lambda: gw.admission.in_flight == 1, 5, "the first request admitted")
    waiting = collect(
        gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2)), timeout_s=0.2
    )
    with pytest.raises(DeadlineExceededError, match="waited past its deadline for admission"):
        await asyncio.wait_for(waiting, 5)  # at the deadline, not when the place frees up (never)
    assert gw.admission.in_flight == 1  # the place is still taken
    assert gw.admission.queued == 0
    gate.set()
    await holder
    assert gw.admission.in_flight == 0


async def test_duplicate_request_ids_in_flight_and_draining_are_refused(checkpoint) -> None:
    gate = asyncio.Event()
    router = FakeRouter("a:1", gate)
    gw = core(checkpoint("mixtral"), [router])
    first = asyncio.create_task(
        collect(
            gw,
            TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2), request_id="x"),
        )
    )
    await eventually(lambda: router.served == ["x"], 5, "the first request at the router")
    with pytest.raises(AlreadyExistsError, match="request_id: 'x' is already in flight"):
        await gw.start(
            TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2), request_id="x")
        )
    gate.set()
    await first
    await collect(
        gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2), request_id="x")
    )  # free again
    gw.draining = True
    with pytest.raises(UnavailableError, match="shutting down"):
        await gw.start(TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2)))


async def test_cut_off_ends_admitted_requests_with_unavailable_and_refuses_queued_ones(
    checkpoint,
) -> None:
    gate = asyncio.Event()  # never opens: streams that would not end by themselves
    router = FakeRouter("a:1", gate)
    gw = core(checkpoint("mixtral"), [router], max_in_flight=1, max_queued=2)
    request = TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2))
    waiting = asyncio.create_task(collect(gw, request))  # inside its router call
    queued = asyncio.create_task(collect(gw, request))
    await eventually(lambda: router.outstanding == 1 and gw.admission.queued == 1, 5, "both")
    gw.cut_off("going away")
    for task in (waiting, queued):
        with pytest.raises(UnavailableError, match="going away"):
            await asyncio.wait_for(task, 2)
    assert gw.admission.in_flight == gw.admission.queued == router.outstanding == 0
    # One admitted afterwards (it passed the draining check just before) is cut at once.
    with pytest.raises(UnavailableError, match="going away"):
        await asyncio.wait_for(collect(gw, request), 2)
    assert gw.admission.in_flight == 0


async def test_cut_off_reaches_a_stream_between_deltas_and_leaves_other_cancellations(
    checkpoint,
) -> None:
    gw = core(checkpoint("mixtral"), [FakeRouter("a:1")])
    async with await gw.start(
        TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=5))
    ) as gen:
        assert (await anext(aiter(gen))).token_ids == [5]
        gw.cut_off("going away")  # its consumer was not waiting: the next step fails
        with pytest.raises(UnavailableError, match="going away"):
            await anext(aiter(gen))
    gate = asyncio.Event()
    gw = core(checkpoint("mixtral"), [FakeRouter("a:1", gate)])
    reader = asyncio.create_task(
        collect(gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=2)))
    )
    await eventually(lambda: gw.admission.in_flight == 1, 5, "the request admitted")
    await asyncio.sleep(0.01)  # inside its router call
    reader.cancel()  # its client left just as the cut came: a cancellation still
    gw.cut_off("going away")
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert gw.admission.in_flight == 0


async def test_the_core_counts_no_failure_itself_the_api_answering_it_does(checkpoint) -> None:
    """A refused or failed request is counted where an API turns it into its answer (an HTTP status
    or error event, a gRPC status), which happens once; the core only raises."""
    telemetry = Telemetry.create("gateway", metrics_port=0)
    try:
        path = checkpoint("mixtral")
        gw = core(path, [ScriptedRouter("a:1", refuses=True)], telemetry=telemetry)
        gw.balancer.budget = RetryBudget(ratio=0.0, min_per_s=0.0)
        too_long = SamplingParams(max_tokens=10**6)
        with pytest.raises(InvalidArgumentError) as refused:
            await gw.start(TextRequest(prompt_token_ids=[1], params=too_long))
        with pytest.raises(UnavailableError) as failed:
            await collect(
                gw, TextRequest(prompt_token_ids=[1], params=SamplingParams(max_tokens=3))
            )
        assert total(scrape(telemetry), "moe_errors_total") == 0
        gw.count_failure(refused.value)
        gw.count_failure(failed.value)
        gw.count_failure("NOT_FOUND")
        counted = scrape(telemetry)
        assert total(counted, "moe_errors_total", rpc_grpc_status_code="INVALID_ARGUMENT") == 1
        assert total(counted, "moe_errors_total", rpc_grpc_status_code="UNAVAILABLE") == 1
        assert total(counted, "moe_errors_total") == 3
    finally:
        telemetry.shutdown()


async def test_validation_resolves_defaults_and_names_fields_as_the_api_does(checkpoint) -> None:
    gw = core(checkpoint("mixtral"), [FakeRouter("a:1")])
    limit, context = gw.settings.max_tokens_limit, gw.model.max_model_len
    ids, params = await gw.validate(TextRequest(prompt_token_ids=[1, 2]))
    assert ids == [1, 2] and params.max_tokens == min(gw.settings.default_max_tokens, context - 2)
    assert params.seed is not None  # sampled: failover continues on the same sample path
    greedy = SamplingParams(max_tokens=None, temperature=0.0)
    _, params = await gw.validate(TextRequest(prompt_token_ids=[1], params=greedy))
    assert params.seed is None
    chat = {"prompt_token_ids": "messages", "max_tokens": "max_completion_tokens"}
    for params, field, why in [
        (SamplingParams(max_tokens=limit + 1), "max_completion_tokens", f"[1, {limit}]"),
        (SamplingParams(max_tokens=context), "max_completion_tokens", "the context length"),
        (SamplingParams(max_tokens=4, top_p=0.0), "top_p", "(0, 1]"),
    ]:
        with pytest.raises(InvalidArgumentError) as e:
            await gw.validate(TextRequest(prompt_token_ids=[1], params=params, names=chat))
        assert e.value.field == field and str(e.value).startswith(f"{field}: "), e.value
        assert why in str(e.value)
    with pytest.raises(InvalidArgumentError) as e:
        await gw.validate(TextRequest(prompt_token_ids=[10**6], names=chat))
    assert e.value.field == "messages"
