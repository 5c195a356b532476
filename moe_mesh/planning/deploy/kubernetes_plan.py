"""The `kubernetes:` section of a deploy plan: namespace, discovery, the model volume, exposure.

Kept beside plan.py (which imports KubernetesPlan from here) because the Kubernetes target has the
most choices of the three: how services find each other (the API's EndpointSlices, or Consul),
where the checkpoint comes from (a PersistentVolumeClaim that a Job fills, or a directory on every
node), and how clients reach the gateway (an Ingress, a LoadBalancer Service, or neither).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A DNS-1123 label: what a namespace, Service, claim or Secret name may be.
K8sName = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        description="lower-case letters, digits and '-', at most 63 characters",
    ),
]
# org/name[@revision], as common/hub.py reads `--checkpoint`.
HfId = Annotated[str, Field(pattern=r"^([A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?)?$")]
Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")]
# DNS-1123 subdomain (an Ingress host, a storage or ingress class), or empty.
Subdomain = Annotated[
    str,
    Field(pattern=r"^([a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*)?$"),
]


Expose = Literal["none", "ingress", "loadbalancer"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelVolumePlan(_Strict):
    """Where every pod reads the checkpoint, mounted read-only at `model.checkpoint`."""

    kind: Literal["pvc", "host_path"] = Field(
        "pvc",
        description="pvc: a PersistentVolumeClaim (rendered unless create_claim is false), filled "
        "once by a Job and read by every pod; host_path: a directory already on every node",
    )
    claim: K8sName = Field("moe-mesh-model", description="the PersistentVolumeClaim's name")
    create_claim: bool = Field(
        True, description="render the claim (false: use an existing one of that name)"
    )
    storage_class: Subdomain = Field(
        "", description="the claim's storageClassName; empty: the cluster's default class"
    )
    size: Quantity = Field("50Gi", description="the claim's requested storage")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        "ReadWriteMany",
        description="ReadWriteMany (NFS, CephFS, EFS, Filestore, ...) lets pods on every node "
        "mount it; ReadWriteOnce binds every pod that mounts it to one node",
    )
    huggingface: HfId = Field(
        "",
        description="Hugging Face model id (org/name[@revision]) the fill Job downloads into the "
        "claim (only the files the mesh reads); HF_TOKEN from the optional Secret "
        "`<plan name>-hf-token` (key token)",
    )
    copy_from_image: str = Field(
        "",
        description="or an image holding the checkpoint at /checkpoint (with a shell and cp, e.g. "
        "FROM busybox), which the fill Job copies into the claim; neither: fill it by hand "
        "(deploy/kubernetes/README.md)",
    )
    host_path: str = Field(
        "", description="with kind host_path: the checkpoint's directory on every node"
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelVolumePlan:
        if self.huggingface and self.copy_from_image:
            raise ValueError("give huggingface or copy_from_image, not both")
        if self.kind == "host_path":
            if not self.host_path.startswith("/"):
                raise ValueError("kind host_path needs host_path, an absolute directory")
            if self.huggingface or self.copy_from_image:
                raise ValueError("a host_path is filled on the nodes: no huggingface or image")
        elif self.host_path:
            raise ValueError("host_path is only read with kind host_path")
        return self


class IngressPlan(_Strict):
    """The Ingress of the gateway's OpenAI HTTP port (expose: ingress)."""

    host: Subdomain = Field("", description="the host it answers for; empty: every host")
    class_name: Subdomain = Field(
        "", description="ingressClassName; empty: the cluster's default IngressClass"
    )
    tls_secret: str = Field(
        "", description="Secret with the certificate the Ingress serves for `host`; empty: none"
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="controller settings, e.g. nginx.ingress.kubernetes.io/backend-protocol: "
        "HTTPS when the gateway itself speaks TLS (security.tls)",
    )


class KubernetesPlan(_Strict):
    namespace: K8sName = Field("moe-mesh", description="namespace of every object")
    discovery: Literal["kubernetes", "consul"] = Field(
        "kubernetes",
        description="kubernetes: services find each other through the API's EndpointSlices of "
        "headless Services (readiness probes register; a ServiceAccount with a Role to list and "
        "watch them); consul: every pod registers in the cluster's Consul (consul_http_addr)",
    )
    model_volume: ModelVolumePlan = ModelVolumePlan()
    expose: Expose = Field(
        "none",
        description="how clients outside the cluster reach the gateway: none (a ClusterIP "
        "Service: kubectl port-forward, or your own Ingress), ingress (an Ingress to the HTTP "
        "port, see `ingress`), loadbalancer (the Service gets type LoadBalancer: gRPC and HTTP)",
    )
    ingress: IngressPlan = IngressPlan()
    health_port: int = Field(
        8081,
        ge=1,
        le=65535,
        description="under security.tls, the plaintext port that serves only the gRPC health "
        "service, which the kubelet's gRPC probes ask (they cannot speak TLS)",
    )
    startup_timeout_s: int = Field(
        600,
        ge=10,
        le=86400,
        description="how long a pod may take to load its weights before the kubelet restarts it "
        "(the startup probe's budget)",
    )
    consul_http_addr: str = Field(
        "consul-server.consul.svc:8500",
        min_length=1,
        description="with discovery consul: the cluster's Consul HTTP API (the Consul Helm "
        "chart's server service)",
    )
    consul_token_secret: K8sName = Field(
        "moe-mesh-consul", description="Secret whose `token` key is CONSUL_HTTP_TOKEN, if present"
    )
    otlp_endpoint: str = Field(
        "", description="OTLP collector for traces (OTEL_EXPORTER_OTLP_ENDPOINT); empty: none"
    )
    prometheus_adapter_namespace: K8sName = Field(
        "monitoring",
        description="namespace of the Prometheus Adapter's Helm release: the rules it serves the "
        "groups' HorizontalPodAutoscalers from are rendered there (prometheus-adapter.yaml)",
    )
