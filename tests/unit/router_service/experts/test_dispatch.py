"""ExpertDispatcher.moe_layer, the call the model makes, against recording backends: the same output
wherever the experts run, colocated preference, failover, deadlines, regions, what it counts."""

from __future__ import annotations

import pytest
import torch

from common.errors import DeadlineExceededError, ExpertUnavailableError
from router_service.engine.pipeline import CallTimes
from router_service.experts import dispatch
from router_service.experts.backends import ColocatedExperts
from router_service.experts.dispatch import ExpertDispatcher
from tests.support.backends import FakeClock, Recording, hidden


async def colocated_output(spec, layer, weights, x: torch.Tensor) -> torch.Tensor:
    local = ColocatedExperts(weights)
    return await ExpertDispatcher(spec, {p: [local] for p in weights}).moe_layer(0, x, layer)


async def test_calls_to_an_expert_are_spread_over_its_replicas(model) -> None:
    spec, layer, weights = model
    a, b = Recording(weights), Recording(weights)
    dispatcher = ExpertDispatcher(spec, {pair: [a, b] for pair in weights})
    reference = await colocated_output(spec, layer, weights, hidden(spec))
    for _ in range(4):
        assert torch.equal(await dispatcher.moe_layer(0, hidden(spec), layer), reference)
    assert set(a.served) & set(b.served)  # the same experts went to both replicas
    assert abs(len(a.served) - len(b.served)) <= len(a.served) // 2
    # Ties rotate per layer call, and a backend gets all its groups of a layer in one call.
    assert dispatcher.remote_calls == 4 and dispatcher.tokens_colocated == 0


async def test_colocated_replica_is_preferred(model) -> None:
    spec, layer, weights = model
    local, remote = ColocatedExperts(weights), Recording(weights)
    dispatcher = ExpertDispatcher(spec, {pair: [remote, local] for pair in weights})
    x = hidden(spec)
    await dispatcher.moe_layer(0, x, layer)
    assert remote.served == []
    assert dispatcher.tokens_colocated == x.shape[0] * spec.top_k


async def test_a_layer_colocated_first_needs_no_network_and_no_retry_budget(model) -> None:
    spec, layer, weights = model
    local, remote = ColocatedExperts(weights), Recording(weights)
    dispatcher = ExpertDispatcher(spec, {pair: [local, remote] for pair in weights})
    calls: list[CallTimes] = []
    x = hidden(spec)
    await dispatcher.moe_layer(0, x, layer, calls=calls)
    assert remote.served == [] and calls == []  # no remote call: nothing for the planner
    routed = x.shape[0] * spec.top_k
    assert dispatcher.tokens_colocated == routed == sum(dispatcher.routed_counts()[0])
    assert dispatcher.budget.retries == 0 and dispatcher.remote_calls == 0


async def test_a_layer_split_between_here_and_a_replica_gives_the_same_output(model) -> None:
    spec, layer, weights = model
    here = ColocatedExperts({p: w for p, w in weights.items() if p[1] % 2 == 0})
    there = Recording({p: w for p, w in weights.items() if p[1] % 2 == 1}, service_s=0.01)
    placement = {p: [here] for p in here.weights} | {p: [there] for p in there.weights}
    dispatcher = ExpertDispatcher(spec, placement)
    calls: list[CallTimes] = []
    x = hidden(spec)
    got = await dispatcher.moe_layer(0, x, layer, calls=calls)
    assert torch.equal(got, await colocated_output(spec, layer, weights, x))
    assert {e % 2 for _, e in there.served} == {1}
    counts = dispatcher.routed_counts()[0]
    assert dispatcher.tokens_colocated == sum(counts[0::2])
    assert len(calls) == 1 and calls[0].service == 0.01 and calls[0].wall >= 0


async def test_a_gpu_routers_layer_staged_in_host_memory_gives_the_same_output(
    model, monkeypatch
) -> None:
    """What a router on a GPU does with a layer that calls remote experts (its rows, routing
    and combine in host memory), taken here on the CPU: the same bits and calls."""
    spec, layer, weights = model
    here = ColocatedExperts({p: w for p, w in weights.items() if p[1] % 2 == 0})
    there = Recording({p: w for p, w in weights.items() if p[1] % 2 == 1})
    placement = {p: [here] for p in here.weights} | {p: [there] for p in there.weights}
    x = hidden(spec)
    want = await ExpertDispatcher(spec, placement).moe_layer(0, x, layer)
    monkeypatch.setattr(dispatch, "staged_on_host", lambda _: True)
    dispatcher = ExpertDispatcher(spec, placement)
    assert torch.equal(await dispatcher.moe_layer(0, x, layer), want)
    assert {e % 2 for _, e in there.served} == {1} and dispatcher.remote_calls == 1


async def test_unavailable_replica_fails_over_and_last_replica_names_the_expert(model) -> None:
    spec, layer, weights = model
    down, up = Recording(weights, fail=True), Recording(weights)
    dispatcher = ExpertDispatcher(spec, {pair: [down, up] for pair in weights})
    await dispatcher.moe_layer(0, hidden(spec), layer)
    assert up.served and dispatcher.failovers == 1

    only_down = ExpertDispatcher(spec, {pair: [down] for pair in weights})
    with pytest.raises(
        ExpertUnavailableError, match=r"layer 0 expert\(s\) .*recording backend is down"
    ) as e:
        await only_down.moe_layer(0, hidden(spec), layer)
    assert e.value.layer == 0 and e.value.experts


async def test_the_deadline_bounds_the_expert_call(model) -> None:
    spec, layer, weights = model
    clock = FakeClock()
    slow = Recording(weights, delay_s=5.0, clock=clock)
    dispatcher = ExpertDispatcher(spec, {pair: [slow] for pair in weights}, clock=clock)
    with pytest.raises(DeadlineExceededError, match="slow backend"):
        await dispatcher.moe_layer(0, hidden(spec), layer, deadline=clock() + 0.2)
    assert slow.timeouts == [pytest.approx(0.2)]  # the call had the request's time left, no more
    assert dispatcher.failovers == 0  # the request's own deadline: nothing to retry
    with pytest.raises(DeadlineExceededError, match="deadline passed"):
        await dispatcher.moe_layer(0, hidden(spec), layer, deadline=clock() - 1)
    local = ColocatedExperts(weights)
    here = ExpertDispatcher(spec, {pair: [local] for pair in weights}, clock=clock)
    with pytest.raises(DeadlineExceededError, match="deadline passed"):  # colocated too
        await here.moe_layer(0, hidden(spec), layer, deadline=clock() - 1)


class Regional(ColocatedExperts):
    local = False

    def __init__(self, weights, region: str, outstanding: int) -> None:
        super().__init__(weights)
        self.region, self.outstanding, self.served = region, outstanding, 0

    async def forward(self, layer, groups, timeout_s=None):
        self.served += 1
        return await super().forward(layer, groups)


async def test_dispatcher_prefers_its_region_until_the_penalty_is_exceeded(model) -> None:
    spec, layer, weights = model
    x = hidden(spec, 16)
    for busy_home, expect_home in ((7, True), (9, False)):
        home, away = Regional(weights, "a", busy_home), Regional(weights, "b", 0)
        d = ExpertDispatcher(spec, {p: [away, home] for p in weights}, region="a", region_penalty=8)
        await d.moe_layer(0, x, layer)
        assert (home.served > 0, away.served > 0) == (expect_home, not expect_home)
        assert d.region == "a"  # what the router's status reports


async def test_a_new_placement_says_whether_a_step_may_wait_on_the_network(model) -> None:
    spec, _, weights = model
    local, remote = ColocatedExperts(weights), Recording(weights)
    dispatcher = ExpertDispatcher(spec, {pair: [local, remote] for pair in weights})
    assert not dispatcher.remote
    dispatcher.set_placement({pair: [remote, local] for pair in weights})
    assert dispatcher.remote and dispatcher.placement[(0, 0)] == [remote, local]
