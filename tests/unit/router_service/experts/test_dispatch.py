"""ExpertDispatcher against recording backends: replica spreading, colocated preference, failover,
deadlines, regions."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from common.checkpoint import Checkpoint
from common.errors import DeadlineExceededError, ExpertUnavailableError, UnavailableError
from common.resilience import EjectionPolicy
from common.telemetry import Telemetry
from router_service.experts.dispatch import (
    ColocatedExperts,
    DispatchPolicy,
    ExpertDispatcher,
)
from tests.support.metrics import scrape, total
from tests.support.polling import eventually


class Recording(ColocatedExperts):
    """Computes like the colocated backend, but looks remote and records which experts it served."""

    local = False

    def __init__(
        self, weights, fail: bool = False, delay_s: float = 0.0, per_row_s: float = 0.0
    ) -> None:
        super().__init__(weights)
        self.fail, self.delay_s, self.per_row_s = fail, delay_s, per_row_s
        self.served: list[tuple[int, int]] = []
        self.checks = 0

    async def check(self, timeout_s):
        """A health check: fails while the backend is down (RemoteExperts.check's stand-in)."""
        self.checks += 1
        if self.fail:
            raise UnavailableError("recording backend is down")

    async def forward(self, layer, groups, timeout_s=None):
        self.outstanding += 1  # as RemoteExperts counts its calls in flight
        try:
            delay_s = self.delay_s + self.per_row_s * sum(rows.shape[0] for _, rows in groups)
            if delay_s:
                await asyncio.sleep(min(delay_s, timeout_s or delay_s))
                if timeout_s is not None and delay_s > timeout_s:
                    raise DeadlineExceededError("slow backend")
            if self.fail:
                raise UnavailableError("recording backend is down")
            self.served += [(layer, e) for e, _ in groups]
            return await super().forward(layer, groups)
        finally:
            self.outstanding -= 1


@pytest.fixture(scope="module")
def model(checkpoint):
    ckpt = Checkpoint(checkpoint("mixtral"))
    return ckpt.spec, ckpt.load_dense().layers[0], ckpt.load_experts(ckpt.all_expert_pairs())


def hidden(spec, n: int = 24) -> torch.Tensor:
    return torch.randn(n, spec.hidden_size, generator=torch.Generator().manual_seed(n))


async def test_calls_to_an_expert_are_spread_over_its_replicas(model) -> None:
    spec, layer, weights = model
    a, b = Recording(weights), Recording(weights)
    dispatcher = ExpertDispatcher(spec, {pair: [a, b] for pair in weights})
    reference = await ExpertDispatcher(spec, {p: [ColocatedExperts(weights)] for p in weights}).moe(
        0, hidden(spec), layer
    )
    for _ in range(4):
        assert torch.equal(await dispatcher.moe(0, hidden(spec), layer), reference)
    assert set(a.served) & set(b.served)  # the same experts went to both replicas
    assert abs(len(a.served) - len(b.served)) <= len(a.served) // 2


async def test_colocated_replica_is_preferred(model) -> None:
    spec, layer, weights = model
    local, remote = ColocatedExperts(weights), Recording(weights)
    dispatcher = ExpertDispatcher(spec, {pair: [remote, local] for pair in weights})
    await dispatcher.moe(0, hidden(spec), layer)
    assert remote.served == []


async def test_unavailable_replica_fails_over_and_last_replica_names_the_expert(model) -> None:
    spec, layer, weights = model
    down, up = Recording(weights, fail=True), Recording(weights)
    dispatcher = ExpertDispatcher(spec, {pair: [down, up] for pair in weights})
    await dispatcher.moe(0, hidden(spec), layer)
    assert up.served and dispatcher.failovers >= 1

    only_down = ExpertDispatcher(spec, {pair: [down] for pair in weights})
    with pytest.raises(
        ExpertUnavailableError, match=r"layer 0 expert\(s\) .*recording backend is down"
    ) as e:
        await only_down.moe(0, hidden(spec), layer)
    assert e.value.layer == 0 and e.value.experts


async def test_deadline_bounds_the_expert_call(model) -> None:
    spec, layer, weights = model
    slow = Recording(weights, delay_s=5.0)
    dispatcher = ExpertDispatcher(spec, {pair: [slow] for pair in weights})
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        await dispatcher.moe(0, hidden(spec), layer, deadline=time.monotonic() + 0.2)
    assert time.monotonic() - start < 1.0
    with pytest.raises(DeadlineExceededError, match="deadline passed"):
        await dispatcher.moe(0, hidden(spec), layer, deadline=time.monotonic() - 1)


async def test_a_call_larger_than_any_before_gets_a_timeout_scaled_to_its_rows(model) -> None:
    """Latencies learned from small (decode) calls must not time out a long prompt's prefill."""
    spec, layer, weights = model
    backend = Recording(weights, delay_s=0.01, per_row_s=0.0005)
    policy = DispatchPolicy(call_timeout_min_s=0.1)
    dispatcher = ExpertDispatcher(spec, {pair: [backend] for pair in weights}, policy=policy)
    for _ in range(20):  # a few rows a call, ~15 ms: the unscaled timeout would be 0.1 s
        await dispatcher.moe(0, hidden(spec, 4), layer)
    await dispatcher.moe(0, hidden(spec, 256), layer)  # 512 rows, ~0.27 s
    assert dispatcher.ejections == 0 and dispatcher.failovers == 0


async def test_a_failing_replica_is_ejected_then_readmitted_after_its_ejection_time(model) -> None:
    spec, layer, weights = model
    down, up = Recording(weights, fail=True), Recording(weights)
    policy = DispatchPolicy(ejection=EjectionPolicy(base_ejection_s=0.3))
    dispatcher = ExpertDispatcher(spec, {pair: [down, up] for pair in weights}, policy=policy)
    await dispatcher.moe(0, hidden(spec), layer)
    assert dispatcher.ejections == 1 and dispatcher.failovers == 1
    up.served.clear()
    for _ in range(5):  # ejected: no call goes to it, so no more failovers
        await dispatcher.moe(0, hidden(spec), layer)
    assert dispatcher.failovers == 1 and up.served
    down.fail = False
    # The ejection time passing is what is tested, and the dispatcher reads the real clock.
    await asyncio.sleep(0.35)
    for _ in range(4):  # re-admitted: it takes calls again (ties rotate between the two)
        await dispatcher.moe(0, hidden(spec), layer)
    assert down.served


async def test_an_ejected_replica_is_back_once_it_passes_a_check_not_when_its_ejection_ends(
    model,
) -> None:
    spec, layer, weights = model
    down, up = Recording(weights, fail=True), Recording(weights)
    policy = DispatchPolicy(ejection=EjectionPolicy(base_ejection_s=30.0))
    telemetry = Telemetry.create("router", metrics_port=0)
    dispatcher = ExpertDispatcher(
        spec, {pair: [down, up] for pair in weights}, telemetry=telemetry, policy=policy
    )
    try:
        await dispatcher.moe(0, hidden(spec), layer)
        assert dispatcher.ejections == 1
        await eventually(lambda: down.checks >= 2, 3, "checks of the ejected replica")
        await dispatcher.moe(0, hidden(spec), layer)
        assert not down.served and dispatcher.ejections == 1  # checks failed: still out
        down.fail = False  # restarted
        start = time.monotonic()
        while not down.served:  # back within about a check interval (0.5 s), not 30 s
            assert time.monotonic() - start < 3.0, "still ejected"
            await dispatcher.moe(0, hidden(spec), layer)
            await asyncio.sleep(0.05)
        assert dispatcher.failovers == 1
        samples = scrape(telemetry)
        assert total(samples, "moe_router_ejections_total") == 1
        checks = "moe_router_ejection_checks_total"
        assert total(samples, checks, moe_outcome="readmitted") == 1
        assert total(samples, checks, moe_outcome="failed") == dispatcher.prober.failed >= 2
    finally:
        await dispatcher.close()
        telemetry.shutdown()


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
            await dispatcher.moe(0, hidden(spec), layer)
        await eventually(lambda: slow.checks >= 3, 3, "checks of the ejected replica")
        # Checks pass (it is up) but say nothing of its speed: only an outage and a return would.
        assert dispatcher._replica(slow).health.ejected and dispatcher.prober.readmitted == 0
        # It leaves the placement: its checks stop.
        dispatcher.set_placement({pair: [fast] for pair in weights})
        await asyncio.sleep(0)
        assert dispatcher.prober.checking == []
    finally:
        await dispatcher.close()


async def test_failovers_stop_when_the_retry_budget_is_spent(model) -> None:
    spec, layer, weights = model
    down, up = Recording(weights, fail=True), Recording(weights)
    # Never ejected, no budget from traffic: every call that lands on `down` costs a retry token.
    policy = DispatchPolicy(
        ejection=EjectionPolicy(consecutive_failures=10**9), retry_budget_ratio=0.0
    )
    dispatcher = ExpertDispatcher(spec, {pair: [down, up] for pair in weights}, policy=policy)
    with pytest.raises(ExpertUnavailableError, match="retry budget exhausted"):
        for _ in range(500):
            await dispatcher.moe(0, hidden(spec), layer)
    assert dispatcher.budget.refused == 1 and 50 <= dispatcher.budget.retries < 500


async def test_a_slow_replica_is_hedged_and_the_faster_answer_is_the_same(model) -> None:
    spec, layer, weights = model
    slow, fast = Recording(weights, delay_s=2.0), Recording(weights)
    dispatcher = ExpertDispatcher(
        spec,
        {pair: [slow, fast] for pair in weights},
        policy=DispatchPolicy(hedge_initial_delay_s=0.05),
    )
    reference = await ExpertDispatcher(spec, {p: [ColocatedExperts(weights)] for p in weights}).moe(
        0, hidden(spec), layer
    )
    start = time.monotonic()
    for _ in range(3):
        assert torch.equal(await dispatcher.moe(0, hidden(spec), layer), reference)
    assert time.monotonic() - start < 1.0
    assert dispatcher.hedges_won >= 1 and dispatcher.ejections >= 1 and not slow.served


async def test_a_call_is_not_hedged_to_a_replica_as_busy(model) -> None:
    """Both replicas busy with a call each: a hedge would answer no sooner and load both."""
    spec, layer, weights = model
    a, b = Recording(weights, delay_s=0.3), Recording(weights, delay_s=0.3)
    dispatcher = ExpertDispatcher(
        spec, {pair: [a, b] for pair in weights}, policy=DispatchPolicy(hedge_initial_delay_s=0.05)
    )
    await asyncio.gather(*(dispatcher.moe(0, hidden(spec, n), layer) for n in (8, 16)))
    assert a.served and b.served and dispatcher.hedges == 0 and dispatcher.ejections == 0


class Regional(ColocatedExperts):
    local = False

    def __init__(self, weights, region: str, outstanding: int) -> None:
        super().__init__(weights)
        self.region, self.outstanding, self.served = region, outstanding, 0

    async def forward(self, layer, groups, timeout_s=None):
        self.served += 1
        return await super().forward(layer, groups)


async def test_dispatcher_prefers_its_region_until_the_penalty_is_exceeded(checkpoint) -> None:
    ckpt = Checkpoint(checkpoint("mixtral"))
    weights, layer = ckpt.load_experts(ckpt.all_expert_pairs()), ckpt.load_dense().layers[0]
    x = torch.randn(16, ckpt.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    for busy_home, expect_home in ((7, True), (9, False)):
        home, away = Regional(weights, "a", busy_home), Regional(weights, "b", 0)
        d = ExpertDispatcher(
            ckpt.spec, {p: [away, home] for p in weights}, region="a", region_penalty=8
        )
        await d.moe(0, x, layer)
        assert (home.served > 0, away.served > 0) == (expect_home, not expect_home)
