"""common/probing.py: ejected endpoints are checked in the background and re-admitted when a check
passes, once they have been seen down; checks stop when they should."""

from __future__ import annotations

import asyncio
import logging

from common.errors import UnavailableError
from common.probing import Prober
from common.resilience import EjectionPolicy, EndpointHealth
from tests.support.polling import eventually

INTERVAL_S = 0.02


class Endpoint:
    """A check that fails while `up` is false, and records how many checks ran at once."""

    def __init__(self, up: bool = False, hang: bool = False) -> None:
        self.up, self.hang = up, hang
        self.checks = self.in_flight = self.most_in_flight = 0
        self.timeouts: list[float] = []

    async def check(self, timeout_s: float) -> None:
        self.checks += 1
        self.timeouts.append(timeout_s)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(100 if self.hang else INTERVAL_S / 4)
            if not self.up:
                raise UnavailableError("connection refused")
        finally:
            self.in_flight -= 1


def ejected(prober: Prober, endpoint: Endpoint, down: bool, health=None) -> EndpointHealth:
    """A health ejected by one failure (for 30 s, the first time), which the prober is told of."""
    health = health or EndpointHealth(EjectionPolicy(base_ejection_s=30.0, max_ejection_s=60.0))
    assert health.failure()
    prober.ejected("e", "10.0.0.1:1", health, endpoint.check, "UNAVAILABLE", down)
    return health


async def test_an_unreachable_endpoint_is_readmitted_by_its_first_passing_check(caplog) -> None:
    caplog.set_level(logging.INFO, "common.probing")
    prober, endpoint = Prober(INTERVAL_S, "replica"), Endpoint()
    health = ejected(prober, endpoint, down=True)
    await eventually(lambda: endpoint.checks >= 3, 2, "failing checks")
    assert health.ejected and prober.failed >= 2
    endpoint.up = True  # restarted
    await eventually(lambda: not health.ejected, 2, "re-admission")
    assert prober.passed == 1  # the first check that passed re-admitted it
    assert prober.readmitted == 1 and prober.checking == []  # re-admitted: no more checks
    assert endpoint.most_in_flight == 1 and set(endpoint.timeouts) == {INTERVAL_S}
    assert health.streak == 1 and health.readmitted  # until a real call succeeds
    assert "replica 10.0.0.1:1 ejected for 30s (ejection 1 in a row): UNAVAILABLE" in caplog.text
    assert "replica 10.0.0.1:1 re-admitted: it passed a health check" in caplog.text


async def test_a_slow_endpoint_is_readmitted_only_after_it_was_seen_down() -> None:
    prober, endpoint = Prober(INTERVAL_S), Endpoint(up=True)
    health = ejected(prober, endpoint, down=False)  # a timeout or a lost hedge race
    await eventually(lambda: prober.passed >= 3, 2, "passing checks")
    assert health.ejected and not prober.readmitted  # up all along: checks say nothing of speed
    endpoint.up = False  # killed ...
    await eventually(lambda: prober.failed >= 1, 2, "a failed check")
    endpoint.up = True  # ... and restarted
    await eventually(lambda: not health.ejected, 2, "re-admission")
    assert prober.readmitted == 1


async def test_a_checks_word_is_taken_once_per_streak() -> None:
    prober, endpoint = Prober(INTERVAL_S), Endpoint(up=True)
    health = ejected(prober, endpoint, down=True)
    await eventually(lambda: not health.ejected, 2, "re-admission")
    health = ejected(prober, endpoint, down=True, health=health)  # its next call failed again
    assert health.streak == 2 and health.ejection_s == 60.0  # the check kept the streak
    await eventually(lambda: prober.passed >= 4, 2, "passing checks")
    assert health.ejected and prober.readmitted == 1  # passing checks proved nothing last time
    endpoint.up = False
    await eventually(lambda: prober.failed >= 1, 2, "a failed check")
    endpoint.up = True
    await eventually(lambda: not health.ejected, 2, "re-admission after an outage")
    health.success()  # a real call succeeded: the next ejection trusts a check again
    health = ejected(prober, endpoint, down=True, health=health)
    await eventually(lambda: not health.ejected, 2, "re-admission")
    assert prober.readmitted == 3


async def test_checks_stop_when_the_endpoint_leaves_or_the_prober_closes() -> None:
    prober, endpoint = Prober(INTERVAL_S), Endpoint(hang=True)
    health = ejected(prober, endpoint, down=True)
    await eventually(lambda: endpoint.checks >= 2, 2, "checks")
    assert endpoint.most_in_flight == 1  # a hung check is cut at the interval
    prober.retain(["other"])
    await asyncio.sleep(0)
    assert prober.checking == [] and endpoint.in_flight == 0
    checks = endpoint.checks
    await asyncio.sleep(3 * INTERVAL_S)
    assert endpoint.checks == checks and health.ejected

    ejected(prober, endpoint, down=True, health=EndpointHealth())
    assert prober.checking == ["e"]
    await prober.close()
    assert prober.checking == [] and endpoint.in_flight == 0
    ejected(prober, endpoint, down=True, health=EndpointHealth())  # closed: logged, not checked
    assert prober.checking == []


async def test_checks_stop_when_the_ejection_runs_out_and_zero_interval_turns_them_off() -> None:
    prober, endpoint = Prober(INTERVAL_S), Endpoint()
    health = EndpointHealth(EjectionPolicy(base_ejection_s=2 * INTERVAL_S))
    ejected(prober, endpoint, down=True, health=health)
    await eventually(lambda: not prober.checking, 2, "the checks to end")
    assert not health.ejected and not prober.readmitted  # its next call is the probe

    off, endpoint = Prober(0.0), Endpoint(up=True)
    health = ejected(off, endpoint, down=True)
    assert off.checking == []
