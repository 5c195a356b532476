"""The decision: HPA's algorithm (tolerance, stabilization windows, step limits, bounds), the
cool-down and the TPOT guard, and a held noisy load that must not flap."""

import random

import pytest
from pydantic import ValidationError

from moe_mesh.autoscale.policy import Autoscale, Recommender


def policy(**over) -> Autoscale:
    base = dict(metric="token_rows", target=100, max_replicas=8, scale_down_window_s=60,
                step_period_s=10, max_step_up=4, max_step_down=1)  # fmt: skip
    return Autoscale(**(base | over))


def test_within_tolerance_nothing_changes():
    d = Recommender("g", policy()).decide(0, current=2, load=109)
    assert (d.raw, d.desired, d.action) == (2, 2, "hold")


def test_over_the_target_scales_up_to_what_the_load_asks():
    d = Recommender("g", policy()).decide(0, current=2, load=250)  # 500 rows/s over 100 each
    assert (d.raw, d.desired, d.action) == (5, 5, "up")


def test_scale_down_waits_for_the_window():
    r = Recommender("g", policy())
    r.decide(0, current=4, load=100)
    held = [r.decide(t, current=4, load=20).desired for t in range(2, 60, 2)]
    assert held == [4] * len(held)  # the recommendation of t=0 (4) is still in the window
    d = r.decide(62, current=4, load=20)
    assert (d.desired, d.action) == (3, "down")  # -1 a step


def test_step_limits_and_bounds():
    d = Recommender("g", policy()).decide(0, current=1, load=1000)
    assert d.raw == 10 and d.desired == 5 and "+4 a step" in d.reason
    d = Recommender("g", policy(max_step_up=10)).decide(0, current=1, load=1000)
    assert d.desired == 8 and "within [1, 8]" in d.reason
    d = Recommender("g", policy(min_replicas=2)).decide(0, current=1, load=10)
    assert d.desired == 2  # below the floor (a replica died): back to it


def test_cool_down_after_a_change():
    r = Recommender("g", policy())
    assert r.decide(0, current=1, load=300).desired == 3
    d = r.decide(4, current=3, load=300)  # still 900 rows/s: 9 wanted
    assert d.desired == 3 and "cooling down" in d.reason
    assert r.decide(12, current=3, load=300).desired == 7  # 9, at most +4


def test_tpot_guard_blocks_scale_down():
    r = Recommender("g", policy(scale_down_window_s=0, tpot_slo_ms=50))
    d = r.decide(0, current=4, load=10, tpot_p99_ms=80)
    assert d.desired == 4 and "SLO" in d.reason
    assert r.decide(20, current=4, load=10, tpot_p99_ms=40).desired == 3


def test_no_measurement_changes_nothing():
    d = Recommender("g", policy()).decide(0, current=3, load=None)
    assert (d.desired, d.reason) == (3, "no measurement yet")


def test_a_held_noisy_load_changes_the_count_at_most_once_a_window():
    """Total load 3 replicas' worth, ±20% each decision, for 10 minutes of 2 s decisions."""
    rng, p = random.Random(1), policy(scale_up_window_s=4)
    r, current, changes = Recommender("g", p), 3, []
    for t in range(0, 600, 2):
        total = 3 * p.target * (1 + rng.uniform(-0.2, 0.2))
        d = r.decide(t, current=current, load=total / current)
        if d.desired != current:
            changes.append(t)
            current = d.desired
    assert changes, "the noise should cross the tolerance at least once"
    assert all(b - a >= p.scale_down_window_s for a, b in zip(changes, changes[1:])), changes


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(metric="token_rows"), "token_rows needs a target"),
        (dict(min_replicas=3, max_replicas=2), "below min_replicas 3"),
        (dict(target=0), "greater than 0"),
    ],
)
def test_bad_policies_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        Autoscale(**fields)


def test_busy_defaults_to_a_target():
    assert Autoscale().level == 0.6 and Autoscale(target=0.8).level == 0.8


def test_a_started_loop_waits_a_window_before_scaling_down_what_it_found():
    r = Recommender("g", policy())
    held = [r.decide(t, current=3, load=0).desired for t in range(0, 60, 2)]
    assert held == [3] * len(held)  # the 3 replicas found count as recommended for 60 s
    assert r.decide(60, current=3, load=0).desired == 2
    assert Recommender("g", policy()).decide(0, current=1, load=500).desired == 5  # up at once


def test_a_busy_target_above_one_is_a_problem_the_plan_and_flags_report():
    assert "fraction of time" in Autoscale(target=60).problem()
    assert Autoscale(metric="token_rows", target=60).problem() is None
