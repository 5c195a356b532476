"""docs/configuration.md: every setting of every service and of the commands built on settings models
(flag, environment variable, default), and the process-wide variables the code reads.

    python -m moe_mesh.dev.configdoc           # rewrite docs/configuration.md
    python -m moe_mesh.dev.configdoc --check   # exit 1 when the committed file is stale

tests/unit/moe_mesh/dev/test_configdoc.py fails when the file is stale or when the code reads a
variable this page does not describe.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticUndefined

from common.cli import add_settings_arguments, flag, settings_from_args

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# Markdown would read these outside code spans: `<time>` as an HTML tag, `*:*` as emphasis.
_SPECIAL = re.compile(r"([\\*_\[\]<>|])")

# Read anywhere in the code, outside the settings models: (name, who reads it, what it does).
PROCESS_WIDE = [
    (
        "MOE_MESH_FAST_PATH",
        "router, expert service",
        "`off` forces gRPC for activations everywhere (the mesh-wide switch of `--fast-path`)",
    ),
    (
        "MOE_MESH_PREPACK",
        "router, expert service",
        "`auto` (default): bfloat16 weights in moe-mesh's own kernel's panels wherever it runs, "
        "an expert service's float32 weights as stored for its batch-invariant kernel, other "
        "float32 weights in the layout the process measured fastest at start-up (plain or "
        "oneDNN's prepacked); `on` oneDNN's (where it has the dtype: faster prefill on AMX "
        "hosts, slower decode), `off` plain, `panels` as `auto`",
    ),
    (
        "MOE_MESH_CACHE_DIR",
        "router, expert service",
        "where the bfloat16 kernel is built on first use and experts in its layout are packed "
        "(`packed/`, a directory per checkpoint path; default `~/.cache/moe-mesh`)",
    ),
    (
        "MOE_MESH_PACK_CACHE",
        "router, expert service",
        "`on` (default): experts held in moe-mesh's bfloat16, int8, int4, FP8 or MXFP4 panels, "
        "and a router's attention and LM-head weights held in bfloat16 panels, are packed once "
        "into files under `$MOE_MESH_CACHE_DIR/packed/` (a file an expert or a weight) that "
        "every process maps, one copy a host; a stale or corrupt file is logged and rebuilt, an "
        "unwritable directory leaves the weights in process memory (with a warning); a mapped "
        "file holds a descriptor, so the process raises its soft open-files limit to the hard "
        "one; `off`: each process packs its own copy",
    ),
    (
        "MOE_MESH_FUSED_DECODE",
        "router",
        "`on` (default): a step of decode tokens only (up to 64 sequences) whose experts "
        "are all colocated runs as one kernel call where the model allows it (bfloat16 panels, "
        "int8 or int4, the plain softmax router; the same bits as op by op); in float32, a step "
        "of one sequence, once its first gave op by op's logits to the bit; `off`: always op by "
        "op",
    ),
    (
        "MOE_MESH_MAX_ISA",
        "router, expert service, benchmarks",
        "the highest instruction set moe-mesh's kernels use: `all` (default; also unset or "
        "empty: every one this CPU has), `avx512` (no AMX tiles, and int8 on the float "
        "kernels), `avx2`, or `none` (torch computes the products; quantized experts refused). "
        "As oneDNN's `ONEDNN_MAX_CPU_ISA`, for moe-mesh's kernels only: to run another host "
        "kind's code on this one, or to rule a kernel out. Greedy tokens can differ from "
        "`all`'s on a CPU with AMX, whose tiles sum a router's products of 8 rows and more in "
        "their own order. Case-insensitive; another value is refused (exit 2) by the commands "
        "that compute or start what does (`up`, `serve-*`, `generate`, `scale`, `autoscale`, "
        "`profile`, `checkpoint`) before they start anything",
    ),
    (
        "MOE_MESH_STEP_PHASES",
        "benchmarks",
        "`1`: the kernels are built (once, as `bf16phases-*.so` beside the usual build) with a "
        "timer on each phase of the one-call decode step; `bench/step_phases.py` sets it and "
        "reads the timers. Unset (default): the usual build. Not for servers",
    ),
    (
        "MOE_MESH_CUDA_GRAPHS",
        "router",
        "`on` (default): on a GPU holding every expert, decode steps replay CUDA graphs captured "
        "once per batch size and context width; `off`: every step launched eagerly",
    ),
    (
        "CC",
        "router, expert service",
        "the C compiler that builds the bfloat16 kernel (default `cc`); none: the kernel is skipped",
    ),
    (
        "MOE_GATEWAY_API_KEY",
        "gateway",
        "API keys the gateway accepts, comma-separated (with or instead of --api-key-file); an "
        "environment variable only, never a flag, so it stays out of process listings",
    ),
    (
        "MOE_MESH_API_KEY",
        "`moe-mesh generate --gateway`",
        "the API key sent as `authorization: Bearer` to a gateway that requires keys",
    ),
    (
        "MOE_MESH_PARENT_PID",
        "services started by `moe-mesh up`",
        "set by the launcher: a service ends within 0.25 s once that process is gone",
    ),
    (
        "CONSUL_HTTP_ADDR",
        "every service, `--registry consul`",
        "Consul's HTTP API (default 127.0.0.1:8500; `moe-mesh up` points it at its embedded registry)",
    ),
    ("CONSUL_HTTP_TOKEN", "every service", "Consul ACL token (also CONSUL_HTTP_TOKEN_FILE)"),
    ("CONSUL_HTTP_TOKEN_FILE", "every service", "a file holding the ACL token"),
    ("CONSUL_HTTP_SSL", "every service", "`true`: HTTPS to the Consul agent"),
    ("CONSUL_HTTP_SSL_VERIFY", "every service", "`false` skips verifying the agent's certificate"),
    ("CONSUL_CACERT", "every service", "CA file for the agent's certificate (also CONSUL_CAPATH)"),
    ("CONSUL_CAPATH", "every service", "CA directory for the agent's certificate"),
    (
        "CONSUL_CLIENT_CERT",
        "every service",
        "client certificate for the agent (with CONSUL_CLIENT_KEY)",
    ),
    ("CONSUL_CLIENT_KEY", "every service", "client key for the agent"),
    (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "every service",
        "OTLP collector: spans are exported there once set (also OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)",
    ),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "every service", "OTLP collector for traces only"),
    (
        "OTEL_TRACES_SAMPLER_ARG",
        "every service",
        "share of new traces recorded when `--trace-sample` is not given (default 0.01)",
    ),
    ("OTEL_TRACES_EXPORTER", "every service", "`none` turns OTLP export off"),
    ("OTEL_SDK_DISABLED", "every service", "`true` turns OpenTelemetry off"),
    (
        "GRPC_VERBOSITY",
        "every process",
        "gRPC core's own log lines; `NONE` unless set (ERROR, INFO or DEBUG bring them back)",
    ),
    (
        "OMP_WAIT_POLICY",
        "every process",
        "how idle OpenMP threads wait; PASSIVE where processes share cores (`up`, compose), else a short spin (GOMP_SPINCOUNT)",
    ),
    (
        "GOMP_SPINCOUNT",
        "every process",
        "OpenMP spin before sleeping; set by default when a process has the cores to itself",
    ),
    (
        "UCX_TLS",
        "router, expert service",
        "UCX transports for the fast path (e.g. `rc,ud,sm,self` on RDMA hosts; see [the UCX fast "
        "path](architecture/fast-path.md))",
    ),
    (
        "UCX_NET_DEVICES",
        "router, expert service",
        "the NICs UCX may use (e.g. `mlx5_0:1`); `lo` by default on a loopback-only mesh",
    ),
    (
        "UCX_RNDV_THRESH",
        "router, expert service",
        "UCX's rendezvous threshold; `intra:2mb,inter:32kb` by default (on one host, eager "
        "messages up to 2 MiB measured faster)",
    ),
    (
        "UCX_MM_SEG_SIZE",
        "router, expert service",
        "UCX's shared-memory fragment size (also `UCX_SYSV_`, `UCX_POSIX_`, `UCX_XPMEM_SEG_SIZE`); 64 KiB "
        "or more turns the fast path off (UCX keeps a fragment's length in 16 bits)",
    ),
    (
        "UCX_MM_ERROR_HANDLING",
        "router, expert service",
        "`y` by default, so a shared-memory endpoint fails cleanly instead of aborting the process",
    ),
    (
        "UCX_WARN_UNUSED_ENV_VARS",
        "router, expert service",
        "`n` by default: UCX's warnings about the variables above",
    ),
    (
        "HF_HUB_OFFLINE",
        "`--checkpoint ORG/NAME`",
        "`1`: resolve Hugging Face model ids from the cache only",
    ),
    ("HF_HOME", "`--checkpoint ORG/NAME`", "Hugging Face's home (the hub cache is HF_HOME/hub)"),
    ("HF_HUB_CACHE", "`--checkpoint ORG/NAME`", "the hub cache directory itself"),
    ("HF_TOKEN", "`--checkpoint ORG/NAME`", "token for gated or private models"),
]


def escape(text: str) -> str:
    """Text for a Markdown paragraph or table cell, code spans (`...`) left as they are."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = _SPECIAL.sub(lambda m: "&lt;" if m[1] == "<" else "\\" + m[1], parts[i])
    return "`".join(parts).replace("\n", " ")


def _models() -> list[tuple[str, str, type[BaseModel], dict[str, str]]]:
    """(command, what it runs, settings model, the flags it renames)."""
    from expert_service.settings import ExpertSettings
    from gateway import cli as gateway_cli
    from gateway.settings import GatewaySettings
    from moe_mesh.benchmark.settings import BenchSettings
    from moe_mesh.local.settings import ScaleSettings, UpSettings
    from router_service import cli as router_cli
    from router_service.settings import RouterSettings

    return [
        ("moe-mesh serve-gateway", "the gateway", GatewaySettings, gateway_cli.FLAGS),
        ("moe-mesh serve-router", "a router", RouterSettings, router_cli.FLAGS),
        ("moe-mesh serve-expert", "an expert service", ExpertSettings, {}),
        ("moe-mesh up", "a mesh on this machine", UpSettings, {}),
        ("moe-mesh scale", "a running `up` mesh", ScaleSettings, {}),
        ("moe-mesh bench", "the serving benchmark", BenchSettings, {}),
    ]


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory else field.default
    if value is PydanticUndefined or value in (None, "", []):
        return "-"
    return f"`{value}`"


def _type(annotation) -> str:
    """A field's type as a reader wants it: no validators, no module names."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    return "None" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def render() -> str:
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m moe_mesh.dev.configdoc` from the settings models; do not edit. -->",
        "",
        "Every service, and the commands below them built on settings models, takes each setting "
        "as a flag or as an environment variable (the flag wins), then falls back to the default. A list variable takes JSON, e.g. "
        "`MOE_GATEWAY_ROUTERS='[\"10.0.0.5:50051\"]'`. Every command's flags, the tools' included: "
        "[CLI reference](reference/cli.md).",
        "",
    ]
    for command, who, model, renamed in _models():
        prefix = model.model_config.get("env_prefix", "")
        lines += [
            f"## `{command}` ({who}, `{prefix}*`)",
            "",
            "| flag | environment variable | type | default | what it does |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, field in model.model_fields.items():
            description = escape(field.description or "")
            lines.append(
                f"| `{renamed.get(name, flag(name))}` | `{prefix}{name.upper()}` "
                f"| {_type(field.annotation)} "
                f"| {_default(field)} | {description} |"
            )
        lines.append("")
    lines += [
        "## Process-wide variables",
        "",
        "| variable | read by | what it does |",
        "| --- | --- | --- |",
        *(f"| `{name}` | {who} | {what} |" for name, who, what in PROCESS_WIDE),
        "",
    ]
    return "\n".join(lines)


class ConfigdocSettings(BaseModel):
    """`python -m moe_mesh.dev.configdoc`'s flags."""

    model_config = ConfigDict(extra="forbid")

    check: bool = Field(False, description="exit 1 when docs/configuration.md is stale")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_mesh.dev.configdoc", description=__doc__)
    add_settings_arguments(p, ConfigdocSettings)
    settings = typing.cast(
        ConfigdocSettings, settings_from_args(ConfigdocSettings, p.parse_args(argv))
    )
    text = render()
    if settings.check:
        stale = not DOC.exists() or DOC.read_text() != text
        if stale:
            print(f"{DOC} is stale: run python -m moe_mesh.dev.configdoc", file=sys.stderr)
        return int(stale)
    DOC.write_text(text)
    print(DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
