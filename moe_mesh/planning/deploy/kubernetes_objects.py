"""The kubernetes target's objects around the Deployments: probes, the model volume and the Job that
fills it, discovery's RBAC, and the gateway's Ingress (kubernetes.py puts them together).

Probes are the kubelet's own gRPC probes (Kubernetes >= 1.27) on the standard health service, not
an exec of `moe-mesh probe` (a Python start per call: 0.77 s and 0.65 CPU-seconds each, as issue 44
measured it, every 10 s in a 0.5-CPU gateway pod with a 3 s timeout): readiness asks the overall
service "" (a gateway missing experts or routers answers NOT_SERVING), liveness and startup ask
LIVENESS, which stays SERVING while the process is sound, so a gateway waiting for an expert group
is taken out of its Service but never restarted. The kubelet's probe has no TLS: under
`security.tls` each service also serves the health service alone in plaintext on
`kubernetes.health_port` (`--health-port`), and the probes ask there.

The checkpoint: a PersistentVolumeClaim that one Job fills (a Hugging Face download of the files the
mesh reads, or a copy out of an image), every pod mounting it read-only behind an init container
that waits for the Job's completion marker; or a directory already on every node (hostPath).
"""

from __future__ import annotations

import math
from typing import Any

from common.hub import ALLOW_PATTERNS, IGNORE_PATTERNS
from moe_mesh.planning.deploy.plan import Plan

LIVENESS = "moe_mesh.liveness"  # common/server.py's (not imported: that module imports grpc)
MODEL_VOLUME = "model"
FILLED = ".moe-mesh-filled"  # the fill Job's last step; pods start once it exists
FILL_DIR = "/fill"
USER = {"runAsNonRoot": True, "runAsUser": 10001}  # the image's user
SERVICE_ACCOUNT = "moe-mesh"
DISCOVERY_LABEL = "moe-mesh.io/service"  # what discovery selects EndpointSlices by
DISCOVERED = {"router": "moe-mesh-router", "expert": "moe-mesh-expert"}
PROBE_PERIOD_S = 10


def labels(plan: Plan, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": plan.name, "app": component}


def meta(plan: Plan, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": plan.kubernetes.namespace, "labels": labels(plan, component)}


# ------------------------------------------------------------------------------------------ probes


def health_port(plan: Plan, grpc_port: int) -> int:
    """Where the kubelet asks: the service's own port, or the plaintext health port under TLS."""
    return plan.kubernetes.health_port if plan.security.tls else grpc_port


def probes(plan: Plan, grpc_port: int) -> dict[str, Any]:
    port = health_port(plan, grpc_port)
    every = {"periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 3}
    live = {"grpc": {"port": port, "service": LIVENESS}, **every}
    budget = math.ceil(plan.kubernetes.startup_timeout_s / PROBE_PERIOD_S)
    return {
        # Loading weights takes a while: liveness starts once the process serves.
        "startupProbe": {**live, "failureThreshold": budget},
        "readinessProbe": {"grpc": {"port": port}, **every},
        "livenessProbe": {**live, "failureThreshold": 3},
    }


# ------------------------------------------------------------------------------------ model volume


def model_volume(plan: Plan) -> dict[str, Any]:
    v = plan.kubernetes.model_volume
    if v.kind == "host_path":
        return {"name": MODEL_VOLUME, "hostPath": {"path": v.host_path, "type": "Directory"}}
    return {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": v.claim, "readOnly": True}}


def wait_for_model(plan: Plan) -> list[dict[str, Any]]:
    """The init container of every pod reading a claim: it waits for the fill's marker, so no
    service starts on a half-copied checkpoint."""
    if plan.kubernetes.model_volume.kind != "pvc":
        return []
    ckpt = plan.model.checkpoint
    script = (
        f'until [ -f "$1/{FILLED}" ]; do echo "waiting for $1/{FILLED}: the fill Job writes it '
        'last (deploy/kubernetes/README.md)"; sleep 10; done'
    )
    return [
        {
            "name": "wait-for-model",
            "image": plan.image,
            "command": ["sh", "-c", script, "wait", ckpt],
            "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": ckpt, "readOnly": True}],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
            "securityContext": USER,
        }
    ]


def _fill_container(plan: Plan) -> dict[str, Any] | None:
    v = plan.kubernetes.model_volume
    done = f'if [ -f {FILL_DIR}/{FILLED} ]; then echo "already filled"; exit 0; fi'
    if v.huggingface:
        repo, _, revision = v.huggingface.partition("@")
        include = " ".join(f"--include '{p}'" for p in ALLOW_PATTERNS)
        exclude = " ".join(f"--exclude '{p}'" for p in IGNORE_PATTERNS)
        fetch = f'hf download "$1" --revision "$2" --local-dir {FILL_DIR} {include} {exclude}'
        args, image = ["fill", repo, revision or "main"], plan.image
        env = [
            {"name": "HF_HOME", "value": "/tmp/hf"},
            {
                "name": "HF_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": f"{plan.name}-hf-token",
                        "key": "token",
                        "optional": True,
                    }
                },
            },
        ]
    elif v.copy_from_image:
        fetch, args, image, env = (
            f"cp -R /checkpoint/. {FILL_DIR}/",
            ["fill"],
            v.copy_from_image,
            [],
        )
    else:
        return None
    return {
        "name": "fill",
        "image": image,
        "command": ["sh", "-c", f"set -e; {done}; {fetch}; touch {FILL_DIR}/{FILLED}", *args],
        **({"env": env} if env else {}),
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": FILL_DIR}],
        "securityContext": USER,
    }


def model_objects(plan: Plan) -> list[dict[str, Any]]:
    """The claim (unless it exists already) and the Job that fills it once (when told from where)."""
    v = plan.kubernetes.model_volume
    if v.kind != "pvc":
        return []
    out = []
    if v.create_claim:
        spec: dict[str, Any] = {
            "accessModes": [v.access_mode],
            "resources": {"requests": {"storage": v.size}},
        }
        if v.storage_class:
            spec["storageClassName"] = v.storage_class
        claim = {**meta(plan, v.claim, "model"), "labels": labels(plan, "model")}
        out.append(
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": claim, "spec": spec}
        )
    fill = _fill_container(plan)
    if fill is not None:
        name = f"{plan.name}-model-fill"
        pod = {
            "restartPolicy": "OnFailure",
            "securityContext": {**USER, "fsGroup": 10001},  # the claim's files are the image user's
            "containers": [fill],
            "volumes": [{"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": v.claim}}],
        }
        out.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": meta(plan, name, "model-fill"),
                "spec": {
                    "backoffLimit": 4,
                    "template": {"metadata": {"labels": labels(plan, "model-fill")}, "spec": pod},
                },
            }
        )
    return out


# --------------------------------------------------------------------------------------- discovery


def discovery_labels(plan: Plan, component: str) -> dict[str, str]:
    """The label discovery lists EndpointSlices by (the Service's labels are copied onto its
    slices): routers and expert groups, under discovery kubernetes."""
    if plan.kubernetes.discovery != "kubernetes":
        return {}
    kind = "expert" if component.startswith("expert-") else component
    return {DISCOVERY_LABEL: DISCOVERED[kind]} if kind in DISCOVERED else {}


def rbac(plan: Plan) -> list[dict[str, Any]]:
    """A ServiceAccount every pod runs as, allowed to list and watch EndpointSlices here only."""
    m = meta(plan, SERVICE_ACCOUNT, "discovery")
    rule = {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": m},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": m,
            "rules": [rule],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": m,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": SERVICE_ACCOUNT,
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": SERVICE_ACCOUNT,
                    "namespace": plan.kubernetes.namespace,
                }
            ],
        },
    ]


# ------------------------------------------------------------------------------------------ ingress


def ingress(plan: Plan) -> dict[str, Any]:
    """The gateway's OpenAI HTTP port behind the cluster's Ingress controller."""
    i = plan.kubernetes.ingress
    path = {
        "path": "/",
        "pathType": "Prefix",
        "backend": {"service": {"name": "gateway", "port": {"name": "http"}}},
    }
    rule: dict[str, Any] = {**({"host": i.host} if i.host else {}), "http": {"paths": [path]}}
    spec: dict[str, Any] = {"rules": [rule]}
    if i.class_name:
        spec["ingressClassName"] = i.class_name
    if i.tls_secret:
        spec["tls"] = [{**({"hosts": [i.host]} if i.host else {}), "secretName": i.tls_secret}]
    metadata = meta(plan, "gateway", "gateway")
    if i.annotations:
        metadata["annotations"] = dict(sorted(i.annotations.items()))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": metadata,
        "spec": spec,
    }
