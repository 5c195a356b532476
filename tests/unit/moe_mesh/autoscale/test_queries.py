"""The autoscaling PromQL: valid for promtool, and computing what the policy means on synthetic
series (`promtool test rules`): the load per replica, the scale-up check that only asks for more,
the scale-down check that holds for its window and under the TPOT guard."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from moe_mesh.autoscale import queries
from moe_mesh.autoscale.policy import SERIES, Autoscale

# The example plan's hot group; a busy policy with both windows and no TPOT guard.
HOT = Autoscale(
    max_replicas=4, metric="token_rows", target=2000, scale_down_window_s=300, tpot_slo_ms=200
)
BUSY = Autoscale(metric="busy", scale_up_window_s=30, scale_down_window_s=120, interval_s=10)


def test_numbers_and_durations_as_promql_writes_them() -> None:
    assert [queries.number(x) for x in (2000, 2000.0, 0.6, 1e-05)] == [
        "2000",
        "2000",
        "0.6",
        "1e-05",
    ]
    durations = [queries.duration(s) for s in (300, 15.0, 7.5, 0.7, 0.0001)]
    assert durations == ["300s", "15s", "7500ms", "700ms", "1ms"]  # integers of one unit only


def test_the_windows_and_the_guard_appear_only_when_set() -> None:
    up, down = (
        queries.scale_up_query(HOT, "experts-hot"),
        queries.scale_down_query(HOT, "experts-hot", "gateway"),
    )
    assert (
        up.startswith("clamp_min((sum(rate(moe_expert_batch_tokens_sum") and "_over_time" not in up
    )
    assert "max_over_time(" in down and "[300s:15s]" in down and "vector(2000)" in down
    assert '{job="gateway"}' in down and "> 0.2" in down  # 200 ms, in seconds
    busy_up = queries.scale_up_query(BUSY, "experts-a")
    busy_down = queries.scale_down_query(BUSY, "experts-a", "gateway")
    assert "min_over_time(" in busy_up and "[30s:10s]" in busy_up and busy_up.endswith(", 0.6)")
    assert "[120s:10s]" in busy_down and "gateway" not in busy_down  # no SLO, no guard
    assert queries.series_in(down) == {
        "moe_expert_batch_tokens_sum",
        "up",
        queries.TPOT_BUCKETS,
    }


def test_adapter_rules_serve_the_rate_per_pod() -> None:
    rule = queries.adapter_rule("busy")
    assert rule["seriesQuery"] == 'moe_expert_compute_duration_seconds_sum{namespace!="",pod!=""}'
    assert rule["name"] == {
        "matches": "^moe_expert_compute_duration_seconds_sum$",
        "as": "moe_expert_busy_fraction",
    }
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert queries.series_in(rule["seriesQuery"]) == {SERIES["busy"]}


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no `promtool` (Debian: prometheus)")


def _promtool_test(tmp_path: Path, series: dict[str, str], expected: dict[str, float]) -> None:
    """`promtool test rules`: each query evaluated at 10 min over series sampled every 15 s."""
    tests = {
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "promql_expr_test": [
                    {"expr": q, "eval_time": "10m", "exp_samples": [{"labels": "{}", "value": v}]}
                    for q, v in expected.items()
                ],
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(tests, width=1000))
    assert PROMTOOL is not None
    r = subprocess.run(
        [PROMTOOL, "test", "rules", str(tmp_path / "test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_the_checks_compute_the_policy_on_synthetic_series(tmp_path: Path) -> None:
    a = HOT
    job, series = "experts-hot", "moe_expert_batch_tokens_sum"
    up, down = queries.scale_up_query(a, job), queries.scale_down_query(a, job, "gateway")
    # Two replicas: 3000 rows/s each until 8 min, then 500 each; TPOT p99 well under 200 ms.
    replicas = {
        f'{series}{{job="{job}",instance="{i}"}}': "0+45000x32 1447500+7500x12" for i in "ab"
    }
    ups = {f'up{{job="{job}",instance="{i}"}}': "1x44" for i in "ab"}
    tpot = {
        f'{queries.TPOT_BUCKETS}{{job="gateway",le="{le}"}}': f"0+{n}x44"
        for le, n in (("0.05", 10), ("0.5", 10), ("+Inf", 10))
    }
    load = queries.per_replica(a.metric, job)
    # Now: 500 per replica; the scale-up check holds (clamped at the target); the scale-down check
    # still sees the window's 3000 (clamped at the target): no change until the window has passed.
    _promtool_test(tmp_path, {**replicas, **ups, **tpot}, {load: 500, up: 2000, down: 2000})
    # Under load: 3000 per replica, the scale-up check asks for it.
    steady = {s: "0+45000x44" for s in replicas}
    _promtool_test(tmp_path, {**steady, **ups, **tpot}, {load: 3000, up: 3000, down: 2000})
    # Quiet for the whole window: the scale-down check asks for fewer.
    quiet = {s: "0+7500x44" for s in replicas}
    _promtool_test(tmp_path, {**quiet, **ups, **tpot}, {up: 2000, down: 500})
    # ... unless the gateway's p99 TPOT is over the SLO (every token over 0.5 s).
    slow = {k: ("0x44" if 'le="+Inf"' not in k else "0+10x44") for k in tpot}
    _promtool_test(tmp_path, {**quiet, **ups, **slow}, {down: 2000})


@needs_promtool
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    exprs = [
        q(policy)
        for policy in (HOT, BUSY, Autoscale(metric="busy", step_period_s=7.5, interval_s=2.5))
        for q in (
            lambda p: queries.per_replica(p.metric, "experts-a"),
            lambda p: queries.scale_up_query(p, "experts-a"),
            lambda p: queries.scale_down_query(p, "experts-a", "gateway"),
        )
    ]
    for metric in SERIES:  # the adapter's template, filled as the adapter fills it
        rule = queries.adapter_rule(metric)
        query = rule["metricsQuery"].replace("<<.Series>>", SERIES[metric])
        exprs.append(
            query.replace("<<.LabelMatchers>>", 'pod=~"a|b"').replace("<<.GroupBy>>", "pod")
        )
    rules = {
        "groups": [
            {
                "name": "autoscale",
                "rules": [{"record": f"q{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules, width=1000))
    assert PROMTOOL is not None
    r = subprocess.run(
        [PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and f"{len(exprs)} rules found" in r.stdout, r.stdout + r.stderr
