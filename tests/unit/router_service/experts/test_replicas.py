"""Replica choice under slow and failing replicas, through the dispatcher's layer call: learned
timeouts, ejection and re-admission, hedging, and the retry budget that bounds failovers and
hedges. Ejections, the budget and latencies read an injected clock."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.errors import ExpertUnavailableError
from common.resilience import EjectionPolicy
from router_service.experts.backends import ColocatedExperts
from router_service.experts.dispatch import ExpertDispatcher
from router_service.experts.replicas import DispatchPolicy
from tests.support.backends import FakeClock, Recording, hidden
from tests.support.polling import eventually


async def test_a_call_larger_than_any_before_gets_a_timeout_scaled_to_its_rows(model) -> None:
    """Latencies learned from small (decode) calls must not time out a long prompt's prefill."""
    spec, layer, weights = model
    clock = FakeClock()
    backend = Recording(weights, delay_s=0.01, per_row_s=0.0005, clock=clock)
    policy = DispatchPolicy(call_timeout_min_s=0.1)
    dispatcher = ExpertDispatcher(
        spec, {pair: [backend] for pair in weights}, policy=policy, clock=clock
    )
    for _ in range(20):  # a few rows a call, ~15 ms: the unscaled timeout would be 0.1 s
        await dispatcher.moe_layer(0, hidden(spec, 4), layer)
    await dispatcher.moe_layer(0, hidden(spec, 256), layer)  # 512 rows, ~0.27 s
    assert dispatcher.ejections == 0 and dispatcher.failovers == 0
    assert 0.27 < backend.timeouts[-1] < 30.0  # scaled up from ~8 x 15 ms, yet learned


async def test_a_failing_replica_is_ejected_then_readmitted_after_its_ejection_time(model) -> None:
    spec, layer, weights = model
    clock = FakeClock()
    down, up = Recording(weights, fail=True), Recording(weights)
    policy = DispatchPolicy(ejection=EjectionPolicy(base_ejection_s=0.3), probe_interval_s=0)
    dispatcher = ExpertDispatcher(
        spec, {pair: [down, up] for pair in weights}, policy=policy, clock=clock
    )
    await dispatcher.moe_layer(0, hidden(spec), layer)
    assert dispatcher.ejections == 1 and dispatcher.failovers == 1
    up.served.clear()
    for _ in range(5):  # ejected: no call goes to it, so no more failovers
        await dispatcher.moe_layer(0, hidden(spec), layer)
    assert dispatcher.failovers == 1 and up.served
    down.fail = False
    clock.advance(0.29)
    await dispatcher.moe_layer(0, hidden(spec), layer)
    assert not down.served  # still ejected
    clock.advance(0.02)
    for _ in range(2):  # re-admitted: it takes calls again (ties rotate between the two)
        await dispatcher.moe_layer(0, hidden(spec), layer)
    assert down.served and dispatcher.failovers == 1


async def test_an_ejected_replica_is_back_once_it_passes_a_check_not_when_its_ejection_ends(
    model,
) -> None:
    spec, layer, weights = model
    down, up = Recording(weights, fail=True), Recording(weights)
    policy = DispatchPolicy(ejection=EjectionPolicy(base_ejection_s=30.0), probe_interval_s=0.05)
    # The dispatcher's clock stands still: only a passed check can end the ejection.
    dispatcher = ExpertDispatcher(
        spec, {pair: [down, up] for pair in weights}, policy=policy, clock=FakeClock()
    )
    try:
        await dispatcher.moe_layer(0, hidden(spec), layer)
        assert dispatcher.ejections == 1
        await eventually(lambda: down.checks >= 2, 3, "checks of the ejected replica")
        await dispatcher.moe_layer(0, hidden(spec), layer)
        assert not down.served and dispatcher.ejections == 1  # checks failed: still out
        assert dispatcher.prober.failed >= 2 and dispatcher.prober.readmitted == 0
        down.fail = False  # restarted
        await eventually(lambda: dispatcher.prober.readmitted == 1, 3, "a passed check")
        for _ in range(2):  # ties rotate between the two
            await dispatcher.moe_layer(0, hidden(spec), layer)
        assert down.served and dispatcher.failovers == 1
    finally:
        await dispatcher.close()


async def test_a_slow_replica_that_answers_checks_still_waits_out_its_ejection(model) -> None:
    spec, layer, weights = model
    slow, fast = Recording(weights, delay_s=2.0), Recording(weights)
    policy = DispatchPolicy(
        hedge_initial_delay_s=0.05,
        ejection=EjectionPolicy(base_ejection_s=30.0),
        probe_interval_s=0.05,
    )
    dispatcher = ExpertDispatcher(spec, {pair: [slow, fast] for pair in weights}, policy=policy)
    try:
        while not dispatcher.ejections:
            await dispatcher.moe_layer(0, hidden(spec), layer)
        await eventually(lambda: slow.checks >= 3, 3, "checks of the ejected replica")
        # Checks pass (it is up) but say nothing of its speed: only an outage and a return would.
        health = dispatcher.replicas.replica(slow).health
        assert health.ejected and dispatcher.prober.readmitted == 0
        # It leaves the placement: its checks stop.
        dispatcher.set_placement({pair: [fast] for pair in weights})
        await asyncio.sleep(0)
        assert dispatcher.prober.checking == []
    finally:
        await dispatcher.close()


async def test_failovers_stop_when_the_retry_budget_is_spent(model) -> None:
    spec, layer, weights = model
    down, up = Recording(weights, fail=True), Recording(weights)
    # Never ejected, no budget from traffic, no time passing: the budget holds its initial reserve.
    policy = DispatchPolicy(
        ejection=EjectionPolicy(consecutive_failures=10**9), retry_budget_ratio=0.0
    )
    dispatcher = ExpertDispatcher(
        spec, {pair: [down, up] for pair in weights}, policy=policy, clock=FakeClock()
    )
    reserve = dispatcher.budget.min_per_s * 10  # RetryBudget's window_s
    with pytest.raises(ExpertUnavailableError, match="retry budget exhausted"):
        for _ in range(500):
            await dispatcher.moe_layer(0, hidden(spec), layer)
    assert dispatcher.budget.refused == 1 and dispatcher.budget.retries == reserve


async def test_a_slow_replica_is_hedged_and_the_faster_answer_is_the_same(model) -> None:
    spec, layer, weights = model
    slow, fast = Recording(weights, delay_s=2.0), Recording(weights)
    dispatcher = ExpertDispatcher(
        spec,
        {pair: [slow, fast] for pair in weights},
        policy=DispatchPolicy(hedge_initial_delay_s=0.05, probe_interval_s=0),
    )
    local = ColocatedExperts(weights)
    reference = await ExpertDispatcher(spec, {p: [local] for p in weights}).moe_layer(
        0, hidden(spec), layer
    )
    for _ in range(3):
        assert torch.equal(await dispatcher.moe_layer(0, hidden(spec), layer), reference)
    # Every answer came from `fast`: the slow replica's calls were hedged, then it was ejected.
    assert dispatcher.hedges_won == dispatcher.hedges >= 1 and dispatcher.ejections >= 1
    assert not slow.served and len(fast.served) == 3 * len(set(fast.served))


async def test_a_spent_retry_budget_sends_no_hedge(model) -> None:
    spec, layer, weights = model
    slow, fast = Recording(weights, delay_s=0.3), Recording(weights)
    dispatcher = ExpertDispatcher(
        spec,
        {pair: [slow, fast] for pair in weights},
        policy=DispatchPolicy(hedge_initial_delay_s=0.05, probe_interval_s=0),
        clock=FakeClock(),  # no time passes: the budget does not refill
    )
    while dispatcher.budget.try_retry():
        pass
    await dispatcher.moe_layer(0, hidden(spec), layer)  # ties go to the first replica: `slow`
    assert slow.served and not fast.served
    assert dispatcher.hedges == 0 and dispatcher.ejections == 0


async def test_a_call_is_not_hedged_to_a_replica_as_busy(model) -> None:
    """Both replicas busy with a call each: a hedge would answer no sooner and load both."""
    spec, layer, weights = model
    a, b = Recording(weights, delay_s=0.3), Recording(weights, delay_s=0.3)
    dispatcher = ExpertDispatcher(
        spec, {pair: [a, b] for pair in weights}, policy=DispatchPolicy(hedge_initial_delay_s=0.05)
    )
    await asyncio.gather(*(dispatcher.moe_layer(0, hidden(spec, n), layer) for n in (8, 16)))
    assert a.served and b.served and dispatcher.hedges == 0 and dispatcher.ejections == 0


async def test_a_call_to_an_expert_with_no_replica_waits_for_one_to_be_placed(model) -> None:
    """A group scaled to 0 under a running stream: the layer call pauses, and completes with the
    same output once a replica is placed again (not UNAVAILABLE at once)."""
    spec, layer, weights = model
    experts = Recording(weights)
    x = hidden(spec)
    want = await ExpertDispatcher(spec, {p: [experts] for p in weights}).moe_layer(0, x, layer)
    without = {p: [experts] for p in weights if p[1] >= 2}  # experts 0 and 1: no replica
    policy = DispatchPolicy(missing_expert_wait_s=30)
    dispatcher = ExpertDispatcher(spec, without, policy=policy)
    call = asyncio.ensure_future(dispatcher.moe_layer(0, x, layer))
    await eventually(lambda: dispatcher.replicas.waiting_for_experts == 1, 5, "the call waits")
    dispatcher.set_placement({**without, (1, 0): [experts]})  # another layer's: still missing
    await asyncio.sleep(0.05)
    assert not call.done() and dispatcher.replicas.waiting_for_experts == 1
    dispatcher.set_placement({p: [experts] for p in weights})
    assert torch.equal(await asyncio.wait_for(call, 5), want)
    assert dispatcher.failovers == 0 and dispatcher.replicas.waiting_for_experts == 0


async def test_a_missing_expert_fails_once_its_wait_is_over(model) -> None:
    spec, layer, weights = model
    without = {p: [Recording(weights)] for p in weights if p[1] >= 2}
    for wait_s, at_least_s in ((0.0, 0.0), (0.2, 0.2)):  # 0: the old behaviour, at once
        policy = DispatchPolicy(missing_expert_wait_s=wait_s)
        dispatcher = ExpertDispatcher(spec, without, policy=policy)
        began = asyncio.get_running_loop().time()
        with pytest.raises(ExpertUnavailableError, match="no replica placed"):
            await dispatcher.moe_layer(0, hidden(spec), layer)
        took = asyncio.get_running_loop().time() - began
        assert at_least_s <= took < at_least_s + 2, (wait_s, took)


async def test_a_failing_replica_with_no_other_copy_fails_at_once_not_after_a_wait(
    model,
) -> None:
    """Waiting is for experts that no replica serves; a placed replica that fails keeps its
    semantics (fail over, or fail), however long missing_expert_wait_s is."""
    spec, layer, weights = model
    policy = DispatchPolicy(missing_expert_wait_s=30, probe_interval_s=0)
    dispatcher = ExpertDispatcher(
        spec, {p: [Recording(weights, fail=True)] for p in weights}, policy=policy
    )
    with pytest.raises(ExpertUnavailableError):
        await asyncio.wait_for(dispatcher.moe_layer(0, hidden(spec), layer), 5)
