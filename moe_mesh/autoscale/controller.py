"""The control loop: every tick read each group's load, decide (policy.Recommender) when the group's
interval is due, scale, and record the decision: a JSON line (to stdout or a file) and metrics
(`moe_autoscaler_*` on the controller's own /metrics).

Groups are scaled one after another: a scale-up returns once its new replicas serve, so a decision
is never taken on a count that is still changing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from opentelemetry.metrics import Observation

from common import telemetry as tm
from common.errors import MoeMeshError
from moe_mesh.autoscale.actuators import Actuator
from moe_mesh.autoscale.policy import UNITS, Autoscale, Decision, Recommender
from moe_mesh.autoscale.signals import Signals


def record(d: Decision, **more) -> dict:
    """A decision as the JSON line the controller writes."""
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(d).items()}
    return out | {"action": d.action} | more


class Controller:
    def __init__(
        self,
        groups: dict[str, Autoscale],
        signals: Signals,
        actuator: Actuator,
        log: Callable[[dict], None],
        telemetry: tm.Telemetry = tm.OFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.groups, self.signals, self.actuator, self.log = groups, signals, actuator, log
        self.clock = clock
        self.start_s = clock()
        self.recommenders = {g: Recommender(g, p) for g, p in groups.items()}
        self.latest: dict[str, Decision] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self._due = dict.fromkeys(groups, 0.0)
        self._export(telemetry)

    @property
    def tick_s(self) -> float:
        """How often loads are sampled: the shortest interval, at most every 5 s (rates need samples)."""
        return min(5.0, *(p.interval_s for p in self.groups.values()))

    def step(self) -> list[Decision]:
        """One tick: sample every group, decide for those whose interval is due."""
        now = self.clock() - self.start_s
        loads = self.signals.read({g: p.metric for g, p in self.groups.items()})
        tpot = self.signals.tpot_p99_ms()
        decisions = []
        for group, policy in self.groups.items():
            if now < self._due[group]:
                continue
            self._due[group] = now + policy.interval_s
            seen = loads.get(group)
            if seen is None:  # no replica serves it: its floor, whatever the windows say
                d = Decision(now, group, policy.metric, None, policy.level, 0, policy.min_replicas,
                             policy.min_replicas, "no replica serving")  # fmt: skip
            else:
                d = self.recommenders[group].decide(now, seen.replicas, seen.load, tpot)
            decisions.append(self._act(d, tpot))
        return decisions

    def _act(self, d: Decision, tpot: float | None) -> Decision:
        more: dict = {"tpot_p99_ms": None if tpot is None else round(tpot, 2)}
        if d.desired != d.current:
            began = self.clock()
            try:
                self.actuator.scale(d.group, d.desired)
                more["scaled_in_s"] = round(self.clock() - began, 2)
            except MoeMeshError as e:
                more["error"] = str(e)
        more["at"] = round(time.time(), 3)  # wall clock, once the new replicas serve
        self.latest[d.group] = d
        key = (d.group, d.action if "error" not in more else "failed")
        self.counts[key] = self.counts.get(key, 0) + 1
        self.log(record(d, **more))
        return d

    def run(self, stop: threading.Event, max_duration_s: float | None = None) -> None:
        """Tick until `stop` is set (or for `max_duration_s`); a failed read is logged and retried."""
        end = None if max_duration_s is None else self.clock() + max_duration_s
        while not stop.is_set() and (end is None or self.clock() < end):
            began = self.clock()
            try:
                self.step()
            except MoeMeshError as e:  # the mesh is restarting, Prometheus is down, ...
                self.log({"time_s": round(began - self.start_s, 2), "at": round(time.time(), 3),
                          "error": str(e)})  # fmt: skip
            stop.wait(max(0.0, self.tick_s - (self.clock() - began)))

    def _export(self, telemetry: tm.Telemetry) -> None:
        def gauge(read: Callable[[Decision], float | None]):
            return lambda _: [
                Observation(v, {"moe.group": g})
                for g, d in self.latest.items()
                if (v := read(d)) is not None
            ]

        meter = telemetry.meter
        meter.create_observable_gauge(
            tm.AUTOSCALER_REPLICAS, [gauge(lambda d: d.desired)], description="replicas set"
        )
        meter.create_observable_gauge(
            tm.AUTOSCALER_RAW, [gauge(lambda d: d.raw)], description="replicas the load asks for"
        )
        meter.create_observable_gauge(
            tm.AUTOSCALER_LOAD, [gauge(lambda d: d.load)], description="load per replica"
        )
        meter.create_observable_gauge(
            tm.AUTOSCALER_TARGET, [gauge(lambda d: d.target)], description="target load"
        )
        meter.create_observable_counter(
            tm.AUTOSCALER_DECISIONS,
            [
                lambda _: [
                    Observation(n, {"moe.group": g, "moe.action": a})
                    for (g, a), n in self.counts.items()
                ]
            ],
            description="decisions by moe.action (up, down, hold, failed)",
        )


def summary(entry: dict) -> str | None:
    """The line a person watching should see for a logged entry: changes and errors, not holds."""
    if "error" in entry:
        return f"!!> autoscale {entry.get('group', '')}: {entry['error']}"
    if entry.get("action") not in ("up", "down"):
        return None
    return (
        f"==> autoscale {entry['group']}: {entry['current']} -> {entry['desired']} replicas "
        f"({entry['load']:.3g} {UNITS[entry['metric']]} per replica, target {entry['target']:g}; "
        f"{entry['reason']})"
    )
