"""Clients of a running mesh: `generate --gateway` and `moe-mesh status`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import typing
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel, ConfigDict, Field

from common.cli import add_settings_arguments, settings_from_args
from common.errors import InvalidArgumentError, MoeMeshError
from common.finish_reason import from_wire
from common.status import error_from_rpc
from common.tls import MeshTls, open_channel
from moe_mesh.ops.coverage import unserved
from moe_mesh.ops.hints import API_KEY_ENV
from moe_mesh.ops.ready import read_ready_file
from protos.moe_mesh.v1 import (
    expert_pb2,
    expert_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)


def mesh_tls(mesh: dict) -> MeshTls | None:
    """The client certificate a ready file of `moe-mesh up --tls` names, or None (plaintext)."""
    files = mesh.get("tls")
    if not files:
        return None
    return MeshTls.load(Path(files["cert"]), Path(files["key"]), Path(files["ca"]))


def client_tls(ready_file: Path | None, ca: Path | None = None) -> MeshTls | None:
    """How a client checks a running mesh: against `ca` (--tls-ca) alone when given, else with the
    client certificate a ready file of `up --tls` names, else plaintext."""
    if ca is not None:
        return MeshTls.ca_only(ca)
    if ready_file is None or not ready_file.exists():
        return None
    return mesh_tls(read_ready_file(ready_file))


def api_key() -> str:
    return os.environ.get(API_KEY_ENV, "").strip()


def api_key_metadata() -> tuple[tuple[str, str], ...]:
    """`authorization` metadata from MOE_MESH_API_KEY, for a gateway that wants API keys."""
    return (("authorization", f"Bearer {key}"),) if (key := api_key()) else ()


async def generate_remote(
    address: str,
    request: inference_pb2.GenerateRequest,
    stream: bool,
    tls: MeshTls | None = None,
) -> dict:
    """Stream a request from the gateway; print text as it arrives when `stream`; return the JSON result."""
    start = time.perf_counter()
    ids: list[int] = []
    text: list[str] = []
    first = None
    last = None
    logprobs: list[dict] = []
    async with open_channel(address, [], tls=tls) as channel:
        try:
            calls = inference_pb2_grpc.InferenceStub(channel)
            async for msg in calls.GenerateStream(request, metadata=api_key_metadata()):
                if first is None and msg.token_ids:
                    first = time.perf_counter() - start
                ids += msg.token_ids
                text.append(msg.text)
                logprobs += [
                    {"logprob": t.logprob, "top": [[a.token_id, a.logprob] for a in t.top]}
                    for t in msg.logprobs
                ]
                if stream and msg.text:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
                last = msg
        except grpc.aio.AioRpcError as e:
            raise _gateway_error(e, address) from e
    latency = time.perf_counter() - start
    assert last is not None
    n = len(ids)
    return {
        "request_id": last.request_id,
        "token_ids": ids,
        "text": "".join(text),
        "finish_reason": from_wire(last.finish_reason),
        "usage": {
            "prompt_tokens": last.usage.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": last.usage.prompt_tokens + n,
        },
        "latency_s": round(latency, 4),
        "time_to_first_token_s": round(first or 0.0, 4),
        "decode_tokens_per_s": round((n - 1) / (latency - first), 2) if n > 1 and first else None,
        **({"logprobs": logprobs} if request.logprobs else {}),
    }


def _gateway_error(e: grpc.aio.AioRpcError, address: str) -> MoeMeshError:
    """A refused request is the user's to fix (exit 2), as is an address that is not a gateway."""
    details = e.details() or ""
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the gateway's details start with the field
        field, sep, message = details.partition(": ")
        return (
            InvalidArgumentError(field, message) if sep else InvalidArgumentError("input", details)
        )
    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        return InvalidArgumentError(
            "--gateway",
            f"{address} does not serve moe-mesh's Inference API: give the gateway's gRPC address "
            "(`moe-mesh up` prints it), not a router's or an expert service's",
        )
    return error_from_rpc(e, peer=address)


async def _health(channel: grpc.aio.Channel) -> str:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=3
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def router_status(address: str, tls: MeshTls | None = None) -> dict:
    """One router's health, load, placement and utilization; only address/health/error when Status fails."""
    async with open_channel(address, [], tls=tls) as ch:
        row: dict = {"address": address, "health": await _health(ch)}
        try:
            st = await router_pb2_grpc.RouterServiceStub(ch).Status(
                router_pb2.RouterStatusRequest(), timeout=3
            )
        except grpc.aio.AioRpcError as e:
            row["error"] = e.code().name
            return row
    row.update(
        model_id=st.model_id,
        running=st.running,
        waiting=st.waiting,
        steps=st.steps,
        failovers=st.failovers,
        hedges=st.hedges,
        ejections=st.ejections,
        registry_stale=st.registry_stale,
        num_layers=st.num_layers,
        num_experts=st.num_experts,
        moe_layers=list(st.moe_layers),
        tokens_routed=_rows(st.tokens_routed, st.num_experts),
        utilization=_rows(st.utilization, st.num_experts),
        window_s=st.utilization_window_s,
        region=st.region,
        expert_bytes=st.expert_bytes,
        colocated_bytes=st.colocated_bytes,
        budget_bytes=st.colocate_budget_bytes,
        promotions=st.promotions,
        demotions=st.demotions,
        pinned_hot=st.pinned_hot,
        pinned_remote=st.pinned_remote,
        remote_calls=st.remote_calls,
        tokens_colocated=st.tokens_colocated,
        placement={p.backend: p.experts for p in st.placement},
        regions={p.backend: p.region for p in st.placement},
        precisions={p.backend: p.precision for p in st.placement},
        replicas=[
            {
                "backend": r.backend,
                "transport": r.transport,
                "fast_path": r.fast_path,
                "fast_path_calls": r.fast_path_calls,
                "fast_path_fallbacks": r.fast_path_fallbacks,
                "fallback_causes": dict(r.fallback_causes),
            }
            for r in st.replicas
        ],
        micro_batches={
            "setting": st.micro_batches_setting,
            "last": st.micro_batches,
            "ta_ms": st.ta_ms,
            "te_ms": st.te_ms,
            "tc_ms": st.tc_ms,
        },
        kv={
            "block_size": st.kv_block_size,
            "blocks_total": st.kv_blocks_total,
            "blocks_used": st.kv_blocks_used,
            "blocks_cached": st.kv_blocks_cached,
            "prefix_query_tokens": st.prefix_cache_query_tokens,
            "prefix_hit_tokens": st.prefix_cache_hit_tokens,
            "preemptions": st.preemptions,
        },
    )
    row["unserved"] = unserved(row)
    return row


async def mesh_status(mesh: dict) -> dict:
    """Health of every service in a ready file written by `moe-mesh up`, what experts serve, router load."""
    out: dict = {"gateway": {}, "routers": [], "experts": []}
    tls = mesh_tls(mesh)
    async with open_channel(mesh["gateway_grpc"], [], tls=tls) as ch:
        out["gateway"] = {
            "address": mesh["gateway_grpc"],
            "http": mesh["gateway_http"],
            "scheme": "https" if tls else "http",
            "health": await _health(ch),
        }
    out["routers"] = [await router_status(address, tls) for address in mesh["routers"]]
    for e in mesh["experts"]:
        async with open_channel(e["address"], [], tls=tls) as ch:
            row = {"address": e["address"], "health": await _health(ch)}
            try:
                d = await expert_pb2_grpc.ExpertServiceStub(ch).Describe(
                    expert_pb2.DescribeRequest(), timeout=3
                )
                row.update(
                    experts=e["experts"],
                    precision=d.precision,
                    device=d.device,
                    forward_calls=d.stats.forward_calls,
                    batches=d.stats.batches,
                    groups=d.stats.groups,
                    tokens=d.stats.tokens,
                )
            except grpc.aio.AioRpcError as err:
                row["error"] = err.code().name
            out["experts"].append(row)
    return out


def _rows(flat, width: int) -> list[list]:
    """A row-major [layers * experts] field as [layers][experts]."""
    return [list(flat[i : i + width]) for i in range(0, len(flat), width)] if width else []


def print_status(st: dict) -> None:
    g = st["gateway"]
    url = f"{g.get('scheme', 'http')}://{g['http']}/v1" if g["http"] else ""  # "": not in Consul
    print(f"gateway  {g['address']:<22} {g['health']:<12} {url}")
    for r in st["routers"]:
        load = f"running {r.get('running', '?')} waiting {r.get('waiting', '?')} steps {r.get('steps', '?')}"
        if r.get("failovers") or r.get("hedges") or r.get("ejections"):
            load += f"  failovers {r['failovers']} hedges {r['hedges']} ejections {r['ejections']}"
        if r.get("registry_stale"):
            load += "  (registry unreachable: serving the last known experts)"
        print(f"router   {r['address']:<22} {r['health']:<12} {r.get('error', load)}")
        if r.get("micro_batches", {}).get("setting"):  # older routers do not say
            print(pipeline_line(r["micro_batches"]))
        if r.get("kv", {}).get("blocks_total"):  # older routers do not say
            print(kv_line(r["kv"]))
        for rep in r.get("replicas", []):
            print(replica_line(rep))
        if r.get("unserved"):
            print(
                f"  !! served by no replica: experts {r['unserved']} (the gateway is not ready; "
                "requests that need them wait for a replica, up to the router's "
                "--missing-expert-wait-s, then fail)"
            )
    for e in st["experts"]:
        where = f" on {e['device']}" if e.get("device") not in (None, "", "cpu") else ""
        stats = f"experts {e.get('experts', '?')} ({e.get('precision') or '?'}{where})  calls {e.get('forward_calls', '?')} batches {e.get('batches', '?')}"
        print(f"expert   {e['address']:<22} {e['health']:<12} {e.get('error', stats)}")
    for r in st["routers"]:
        if "tokens_routed" in r:
            print(f"\ntokens routed per (layer, expert) by router {r['address']}:")
            print(heatmap(r["tokens_routed"]))


def pipeline_line(p: dict) -> str:
    """How the router splits its steps, and the per-layer costs `auto` plans with once measured."""
    line = f"  micro-batches {p['last']} ({p['setting']})"
    if p["ta_ms"] or p["te_ms"]:
        line += (
            f"  per layer: router {p['ta_ms']:.2f} ms, experts {p['te_ms']:.2f} ms, "
            f"transfer {p['tc_ms']:.2f} ms each way"
        )
    return line


def kv_line(kv: dict) -> str:
    """The KV cache's blocks and the prefix cache's hit rate since start."""
    total, used, cached = kv["blocks_total"], kv["blocks_used"], kv["blocks_cached"]
    line = (
        f"  kv cache {used}/{total} blocks used ({100 * used / total:.0f}%), {cached} cached, "
        f"{total - used - cached} free, {kv['block_size']} tokens each"
    )
    queried = kv["prefix_query_tokens"]
    if queried:
        line += (
            f"; prefix cache hits {100 * kv['prefix_hit_tokens'] / queried:.1f}% "
            f"of {queried} tokens"
        )
    if kv["preemptions"]:
        line += f"; {kv['preemptions']} preemptions"
    return line


def replica_line(r: dict) -> str:
    """One expert backend of a router: the transport its next call takes and the fast path's record."""
    line = f"  -> {r['backend']:<22} {r['transport']:<9}"
    if r["fast_path"]:  # its worker address (~250 characters) is in --json
        line += f" fast path calls {r['fast_path_calls']} fallbacks {r['fast_path_fallbacks']}"
        if r["fallback_causes"]:
            causes = ", ".join(f"{c} {n}" for c, n in sorted(r["fallback_causes"].items()))
            line += f" ({causes})"
    elif r["transport"] == "grpc":
        line += " no fast path"
    return line


def heatmap(counts: list[list[int]]) -> str:
    """Layers x experts table of routed token counts, each layer's hottest expert marked with *."""
    lines = ["layer " + "".join(f"{f'e{e}':>8}" for e in range(len(counts[0]) if counts else 0))]
    for layer, row in enumerate(counts):
        hot = max(range(len(row)), key=row.__getitem__) if any(row) else -1
        lines.append(
            f"{layer:>5} " + "".join(f"{v:>7}{'*' if e == hot else ' '}" for e, v in enumerate(row))
        )
    return "\n".join(lines)


def run(coro):
    return asyncio.run(coro)


# -- `moe-mesh status` ---------------------------------------------------------------------------


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    _add_status(subparsers)


class StatusSettings(BaseModel):
    """`moe-mesh status`'s flags."""

    model_config = ConfigDict(extra="forbid")

    ready_file: Path | None = Field(
        None,
        description="the file `moe-mesh up --ready-file` wrote",
        json_schema_extra={"metavar": "FILE"},
    )
    gateway: str | None = Field(
        None,
        description="instead of --ready-file, for a mesh started without `up`: its gateway's gRPC "
        "address, its routers and expert services found in the Consul they registered in",
        json_schema_extra={"metavar": "HOST:PORT"},
    )
    registry_address: str | None = Field(
        None, description="with --gateway: Consul's HTTP address (default CONSUL_HTTP_ADDR)"
    )
    as_json: bool = Field(False, description="print JSON instead of tables")


STATUS_FLAGS = {"as_json": "--json"}


def _add_status(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="health, experts and load of a running mesh",
        description="Query every service of a mesh: one `moe-mesh up` started (--ready-file), "
        "or one started by hand (--gateway, with the Consul its services registered in).",
    )
    add_settings_arguments(p, StatusSettings, flags=STATUS_FLAGS)
    p.set_defaults(func=_run_status)


async def registered_mesh(gateway: str, registry_address: str | None) -> dict:
    """What a ready file would say of a mesh started by hand: its gateway, and the routers and
    expert services passing their health checks in Consul. UnavailableError naming the registry
    where it cannot be read."""
    from common.registry import EXPERT_SERVICE, ROUTER_SERVICE
    from common.registry.consul import ConsulRegistry

    try:
        registry = ConsulRegistry(registry_address)
    except ValueError as e:  # a malformed address
        raise InvalidArgumentError("--registry-address", str(e)) from None
    try:
        routers = await registry.instances(ROUTER_SERVICE)
        experts = await registry.instances(EXPERT_SERVICE)
    finally:
        await registry.close()
    return {
        "gateway_grpc": gateway,
        "gateway_http": "",
        "routers": [r.endpoint for r in routers],
        "experts": [{"address": e.endpoint, "experts": e.meta.get("experts", "")} for e in experts],
    }


def _run_status(args: argparse.Namespace) -> int:
    s = typing.cast(StatusSettings, settings_from_args(StatusSettings, args, flags=STATUS_FLAGS))
    if (s.ready_file is None) == (s.gateway is None):
        raise InvalidArgumentError(
            "--ready-file",
            "give --ready-file FILE (a mesh `moe-mesh up` started) or --gateway HOST:PORT (one "
            "started by hand), not both or neither",
        )
    if s.ready_file is not None:
        mesh = read_ready_file(s.ready_file, "gateway_grpc", "gateway_http", "routers", "experts")
    else:
        mesh = asyncio.run(registered_mesh(typing.cast(str, s.gateway), s.registry_address))
    status = asyncio.run(mesh_status(mesh))
    if s.as_json:
        print(json.dumps(status))
    else:
        print_status(status)
    healthy = [s["health"] for s in [status["gateway"], *status["routers"], *status["experts"]]]
    whole = not any(r.get("unserved") for r in status["routers"])
    return 0 if whole and all(h == "SERVING" for h in healthy) else 1
