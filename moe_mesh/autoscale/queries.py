"""The PromQL of every autoscaling metric, one copy for the rendered orchestrator objects.

A group's load per replica is the rate of one counter every expert service exports (policy.SERIES),
over RATE_WINDOW, averaged over the group's replicas. Kubernetes reads it through the Prometheus
Adapter (`adapter_rule`: the adapter sums each pod's rate and the HPA averages over the pods);
Nomad's autoscaler runs the queries itself (`scale_up_query`, `scale_down_query`), which also carry
the policy's stabilization windows and TPOT guard, since its target-value strategy has neither.
"""

from __future__ import annotations

import re

from moe_mesh.autoscale.policy import SERIES, Autoscale

# Four scrapes at the rendered 15 s interval: a rate needs two samples, and a missed scrape must
# not turn a replica's load into nothing.
RATE_WINDOW = "1m"
# The custom metric the Prometheus Adapter serves the HPA for each policy metric.
ADAPTER_METRIC = {
    "token_rows": "moe_expert_token_rows_per_second",
    "busy": "moe_expert_busy_fraction",
}
# The gateway's time per output token (OpenTelemetry's GenAI name), for the scale-down guard.
TPOT_BUCKETS = "gen_ai_server_time_per_output_token_seconds_bucket"


def number(x: float) -> str:
    """A PromQL / HCL number: 2000, not 2000.0; 0.6, not 0.59999."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def duration(seconds: float) -> str:
    """A PromQL duration (integers of one unit only): 300 -> '300s', 7.5 -> '7500ms'."""
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def adapter_rule(metric: str) -> dict:
    """One rule in the Prometheus Adapter's `rules:` format: the counter's rate per pod, served as
    ADAPTER_METRIC[metric] for pods (the scrape job labels every series with namespace and pod)."""
    series = SERIES[metric]
    return {
        "seriesQuery": f'{series}{{namespace!="",pod!=""}}',
        "resources": {
            "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        },
        "name": {"matches": f"^{series}$", "as": ADAPTER_METRIC[metric]},
        "metricsQuery": (
            f"sum(rate(<<.Series>>{{<<.LabelMatchers>>}}[{RATE_WINDOW}])) by (<<.GroupBy>>)"
        ),
    }


def per_replica(metric: str, job: str, window: str = RATE_WINDOW) -> str:
    """The load per replica of the group scraped as Prometheus job `job`: the group's total rate
    over the replicas whose scrape succeeded (a replica that computes nothing still counts)."""
    total = f'sum(rate({SERIES[metric]}{{job="{job}"}}[{window}]))'
    # No series yet (a replica creates it at its first batch) is no load, not no measurement.
    return f'({total} or vector(0)) / count(up{{job="{job}"}} == 1)'


def _over(function: str, query: str, window_s: float, step_s: float) -> str:
    if window_s <= 0:
        return query
    return f"{function}(({query})[{duration(window_s)}:{duration(step_s)}])"


def scale_up_query(policy: Autoscale, job: str) -> str:
    """The smallest load of the scale-up window, never under the target: it can only ask for more
    replicas (HPA's scale-up stabilization)."""
    load = _over(
        "min_over_time",
        per_replica(policy.metric, job),
        policy.scale_up_window_s,
        policy.interval_s,
    )
    return f"clamp_min({load}, {number(policy.level)})"


def scale_down_query(policy: Autoscale, job: str, gateway_job: str) -> str:
    """The largest load of the scale-down window, never over the target: it can only ask for fewer
    replicas (HPA's scale-down stabilization). With a TPOT SLO it reads the target itself (no
    change) while the gateway's p99 time per output token is over the SLO."""
    load = _over(
        "max_over_time",
        per_replica(policy.metric, job),
        policy.scale_down_window_s,
        policy.interval_s,
    )
    query = f"clamp_max({load}, {number(policy.level)})"
    if policy.tpot_slo_ms is None:
        return query
    slo_s = number(policy.tpot_slo_ms / 1000)
    return (
        f"({query} unless on() ({tpot_p99(gateway_job)} > {slo_s})) "
        f"or on() vector({number(policy.level)})"
    )


def tpot_p99(gateway_job: str, window: str = RATE_WINDOW) -> str:
    """The p99 time per output token, in seconds, of the tokens the gateways streamed in `window`."""
    rate = f'rate({TPOT_BUCKETS}{{job="{gateway_job}"}}[{window}])'
    return f"histogram_quantile(0.99, sum by (le) ({rate}))"


_NAME = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")


def series_in(query: str) -> set[str]:
    """The metric names a rendered query or adapter rule selects (`name{...}`), Prometheus' own
    `up` included."""
    return set(_NAME.findall(query))
