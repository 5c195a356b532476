"""The secrets of a deployment under `security` (plan.SecurityPlan): which files each component
reads, the flags that name them, and the health probe that presents them.

Every target mounts the same file names in one directory per container (compose /run/secrets,
Kubernetes a projected Secret volume, Nomad the task's secrets dir from Nomad Variables), so
certificates, keys and API keys are files a process reads, never environment values a plain file
holds. Certificates come from `moe-mesh certs --host <security.server_name>`: one per kind of
component (every expert group shares the `expert` one), each naming the mesh's server name, which
the services check instead of the address they dial (a pod IP or a container id).
"""

from __future__ import annotations

from moe_mesh.planning.deploy.plan import Plan

CA, CERT, KEY = "tls-ca.pem", "tls-cert.pem", "tls-key.pem"
API_KEYS, CONSUL_TOKEN = "api-keys", "consul-token"
# What `moe-mesh certs --out DIR` writes, by the name a container reads it under.
CERTS_OUTPUT = {CA: "ca.pem", CERT: "{kind}.pem", KEY: "{kind}-key.pem"}
KINDS = ("expert", "router", "gateway")


def kind(component: str) -> str:
    """Whose certificate a component presents: expert-<group> -> expert."""
    return "expert" if component.startswith("expert") else component


def secure(plan: Plan) -> bool:
    return plan.security.tls or plan.security.api_keys


def files(plan: Plan, component: str) -> list[str]:
    """The secret files `component` mounts, by name in its secrets directory."""
    out = [CA, CERT, KEY] if plan.security.tls else []
    if plan.security.api_keys and kind(component) == "gateway":
        out.append(API_KEYS)
    return out + ([CONSUL_TOKEN] if secure(plan) else [])


def _tls_flags(plan: Plan, directory: str) -> list[str]:
    """The certificate flags a service and its probe share (none without `security.tls`)."""
    if not plan.security.tls:
        return []
    return [
        *("--tls-cert", f"{directory}/{CERT}", "--tls-key", f"{directory}/{KEY}"),
        *("--tls-ca", f"{directory}/{CA}", "--tls-server-name", plan.security.server_name),
    ]


def flags(plan: Plan, component: str, directory: str) -> list[str]:
    """The service flags naming its secret files in `directory`."""
    out = _tls_flags(plan, directory)
    if plan.security.api_keys and kind(component) == "gateway":
        out += ["--api-key-file", f"{directory}/{API_KEYS}"]
    return out


def probe(plan: Plan, port: str, directory: str) -> list[str]:
    """`moe-mesh probe` of a service on this host, presenting its own certificate under TLS."""
    return ["moe-mesh", "probe", f"127.0.0.1:{port}", *_tls_flags(plan, directory)]
