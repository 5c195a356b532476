"""The loop: decisions acted on and recorded (JSON lines, metrics), failures logged not raised,
each group at its own interval, a group without replicas brought to its floor."""

import threading

from common import telemetry as tm
from common.errors import UnavailableError
from moe_mesh.autoscale.controller import Controller
from moe_mesh.autoscale.policy import Autoscale
from moe_mesh.autoscale.signals import GroupLoad
from tests.support.metrics import scrape, total


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Signals:
    """What the services would say: a load per group, set by the test."""

    def __init__(self, loads: dict) -> None:
        self.loads, self.reads = loads, 0

    def read(self, metrics):
        self.reads += 1
        return {g: v for g, v in self.loads.items() if g in metrics}

    def tpot_p99_ms(self):
        return 42.0


class Actuator:
    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = [], fail

    def scale(self, group, replicas):
        self.calls.append((group, replicas))
        if self.fail:
            raise UnavailableError("no room for another replica")


def test_decisions_are_acted_on_logged_and_exported():
    policy = Autoscale(metric="token_rows", target=100, interval_s=2)
    signals = Signals({"a": GroupLoad(1, 350.0), "b": GroupLoad(2, 100.0)})
    actuator, log, clock = Actuator(), [], Clock()
    telemetry = tm.Telemetry.create("autoscaler-test", metrics_port=0)
    c = Controller({"a": policy, "b": policy}, signals, actuator, log.append, telemetry, clock)
    c.step()
    assert actuator.calls == [("a", 4)]
    by_group = {e["group"]: e for e in log}
    assert by_group["a"]["action"] == "up" and by_group["a"]["tpot_p99_ms"] == 42.0
    assert by_group["b"]["action"] == "hold" and "at" in by_group["b"]
    seen = scrape(telemetry)
    telemetry.shutdown()
    assert total(seen, "moe_autoscaler_replicas", moe_group="a") == 4
    assert total(seen, "moe_autoscaler_recommended_replicas", moe_group="a") == 4
    assert total(seen, "moe_autoscaler_load", moe_group="a") == 350
    assert total(seen, "moe_autoscaler_target", moe_group="b") == 100
    assert total(seen, "moe_autoscaler_decisions_total", moe_group="b", moe_action="hold") == 1


def test_each_group_at_its_own_interval():
    fast, slow = Autoscale(interval_s=2), Autoscale(interval_s=10)
    log, clock = [], Clock()
    c = Controller({"f": fast, "s": slow}, Signals({"f": GroupLoad(1, 0.6), "s": GroupLoad(1, 0.6)}),
                   Actuator(), log.append, clock=clock)  # fmt: skip
    for _ in range(5):
        c.step()
        clock.now += 2
    assert [e["group"] for e in log].count("f") == 5
    assert [e["group"] for e in log].count("s") == 1
    assert c.tick_s == 2


def test_a_failed_scale_is_logged_and_the_loop_goes_on():
    actuator, log = Actuator(fail=True), []
    c = Controller({"a": Autoscale()}, Signals({"a": GroupLoad(1, 0.99)}), actuator, log.append,
                   clock=Clock())  # fmt: skip
    c.step()
    assert log[0]["error"] == "no room for another replica"
    assert c.counts == {("a", "failed"): 1}


def test_a_group_without_replicas_goes_to_its_floor():
    actuator, log = Actuator(), []
    c = Controller(
        {"a": Autoscale(min_replicas=2)}, Signals({}), actuator, log.append, clock=Clock()
    )
    c.step()
    assert actuator.calls == [("a", 2)] and log[0]["reason"] == "no replica serving"


def test_run_stops_when_asked_and_survives_a_failed_read():
    class Broken(Signals):
        def read(self, metrics):
            self.reads += 1
            raise UnavailableError("Prometheus at http://127.0.0.1:1: connection refused")

    signals, log, stop = Broken({}), [], threading.Event()
    c = Controller({"a": Autoscale(interval_s=0.01)}, signals, Actuator(), log.append)
    t = threading.Thread(target=c.run, args=(stop,))
    t.start()
    while signals.reads < 3:
        stop.wait(0.01)
    stop.set()
    t.join(5)
    assert not t.is_alive() and "connection refused" in log[0]["error"]
