"""The Prometheus scrape configuration rendered with every deployment, one job per component.

Every service serves its metrics on METRICS_PORT (`--metrics-port`). How Prometheus finds the
replicas depends on the target: compose resolves a service name to all its containers (DNS A
records), Nomad registers each task in Consul, Kubernetes annotates each pod.
"""

from __future__ import annotations

from typing import Any

import yaml

METRICS_PORT = 9400
SCRAPE_INTERVAL = "15s"


def static_job(name: str, targets: list[str]) -> dict[str, Any]:
    return {"job_name": name, "static_configs": [{"targets": targets}]}


def dns_job(name: str, host: str, port: int = METRICS_PORT) -> dict[str, Any]:
    """Every address `host` resolves to (compose: each replica of a service)."""
    return {
        "job_name": name,
        "dns_sd_configs": [{"names": [host], "type": "A", "port": port, "refresh_interval": "15s"}],
    }


def consul_job(name: str, service: str, consul: str) -> dict[str, Any]:
    """Every instance of a Consul service (Nomad registers each task's metrics port)."""
    return {"job_name": name, "consul_sd_configs": [{"server": consul, "services": [service]}]}


def kubernetes_pods_job(namespace: str) -> dict[str, Any]:
    """Pods annotated prometheus.io/scrape=true in `namespace`, at their prometheus.io/port, each
    series labelled with its component, namespace and pod."""
    return {
        "job_name": "moe-mesh",
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [namespace]}}],
        "relabel_configs": [
            {
                "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
                "regex": "true",
                "action": "keep",
            },
            {
                "source_labels": [
                    "__address__",
                    "__meta_kubernetes_pod_annotation_prometheus_io_port",
                ],
                "regex": r"([^:]+)(?::\d+)?;(\d+)",
                "replacement": "$1:$2",
                "target_label": "__address__",
            },
            {"source_labels": ["__meta_kubernetes_pod_label_app"], "target_label": "component"},
            # The Prometheus Adapter maps these two labels to the pods an HPA averages over.
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }


def prometheus_yml(jobs: list[dict[str, Any]], interval: str = SCRAPE_INTERVAL) -> str:
    config = {"global": {"scrape_interval": interval}, "scrape_configs": jobs}
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=1000)
