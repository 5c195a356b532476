"""`moe-mesh up` as a user runs it: a whole mesh of processes, then status, generate, a dying child, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import grpc

from common.arch import load_spec
from common.fastpath.ucx import load_ucxx
from common.finish_reason import from_wire
from moe_mesh.local.processes import running_up
from moe_mesh.ops.traces import load_spans
from moe_mesh.planning.calibrate import observed
from protos.moe_mesh.v1 import (
    expert_pb2,
    expert_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)
from tests.support.cli import moe_mesh
from tests.support.net import free_port
from tests.support.polling import wait_until
from tests.support.reference import PROMPTS, monolithic


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is gone for our purposes once its state is Z
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


async def _forward_calls(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await expert_pb2_grpc.ExpertServiceStub(channel).Describe(
            expert_pb2.DescribeRequest(), timeout=5
        )
        return reply.stats.forward_calls


def _until_eos(tokens: tuple[int, ...], eos: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """`tokens` up to and including the first EOS (finish "stop"), else all of them ("length")."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tuple(tokens[: i + 1]), "stop"
    return tuple(tokens), "length"


def _status_experts(ready: Path) -> dict[str, str]:
    """address -> experts of every expert service `moe-mesh status` shows."""
    return _experts_of(json.loads(moe_mesh("status", "--ready-file", ready, "--json").stdout))


def _experts_of(status: dict) -> dict[str, str]:
    return {e["address"]: e["experts"] for e in status["experts"]}


def test_up_serves_local_engine_tokens_reports_dead_children_and_stops_cleanly(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral")
    ready = tmp_path / "mesh.json"
    grpc_port, http_port = free_port(), free_port()
    ports = ["--grpc-port", str(grpc_port), "--http-port", str(http_port)]
    flags = ["--expert-services", "2", "--replicas", "2", "--trace-sample", "1.0", *ports]
    with running_up(
        path, flags, ready_file=ready, run_dir=tmp_path / "run", log_path=tmp_path / "up.log",
        ready_timeout_s=120, stop_timeout_s=60,
    ) as running:  # fmt: skip
        up, mesh = running.proc, running.info
        assert {"gateway_grpc", "gateway_http", "routers", "experts"} <= set(mesh) and len(
            mesh["experts"]
        ) == 4
        assert mesh["gateway_grpc"] == f"127.0.0.1:{grpc_port}"
        assert mesh["gateway_http"] == f"127.0.0.1:{http_port}"
        # Both ports are taken now: a second gateway on them fails in one line naming the address.
        for flag, port in (("--grpc-port", grpc_port), ("--http-port", http_port)):
            r = moe_mesh(
                "serve-gateway",
                "--checkpoint",
                path,
                "--router",
                mesh["routers"][0],
                *ports,
                *(("--grpc-port", str(free_port())) if flag == "--http-port" else ()),
            )
            assert r.returncode == 1, (r.returncode, r.stderr)
            lines = [line for line in r.stderr.splitlines() if "error" in line.lower()]
            assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], r.stderr
            assert "in use" in lines[0] and "Traceback" not in r.stderr, r.stderr

        # The gateway stops at EOS; the reference ignores it: what the mesh must answer, whole.
        eos = load_spec(path).eos_token_ids
        expected = [_until_eos(want, eos) for want in monolithic(path)]

        async def generate_all() -> list[tuple[tuple[int, ...], str]]:
            async with grpc.aio.insecure_channel(mesh["gateway_grpc"]) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                replies = [
                    await stub.Generate(
                        inference_pb2.GenerateRequest(
                            prompt_token_ids=p, max_tokens=32, temperature=0.0
                        )
                    )
                    for p in PROMPTS
                ]
            return [(tuple(r.token_ids), from_wire(r.finish_reason)) for r in replies]

        assert asyncio.run(generate_all()) == expected

        status = moe_mesh("status", "--ready-file", ready, "--json")
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert st["gateway"]["health"] == "SERVING" and all(
            e["health"] == "SERVING" for e in st["experts"]
        )
        assert sum(map(sum, st["routers"][0]["tokens_routed"])) > 0
        # A mesh started by hand has no ready file: its gateway and the registry find the rest.
        found = moe_mesh("status", "--gateway", mesh["gateway_grpc"], "--registry-address",
                         mesh["registry"], "--json")  # fmt: skip
        assert found.returncode == 0, found.stderr
        by_registry = json.loads(found.stdout)
        assert [r["address"] for r in by_registry["routers"]] == mesh["routers"]
        assert _experts_of(by_registry) == _experts_of(st) and len(st["experts"]) == 4
        # `up` uses the fast path by default: status names each replica's transport and record.
        replicas = [r for r in st["routers"][0]["replicas"] if r["backend"] != "colocated"]
        assert len(replicas) == 4
        if load_ucxx(loopback=True) is not None:
            assert all(r["transport"] == "ucx" and not r["fast_path_fallbacks"] for r in replicas)
            assert sum(r["fast_path_calls"] for r in replicas) > 0
            table = moe_mesh("status", "--ready-file", ready)
            assert table.returncode == 0 and table.stdout.count(" ucx ") == 4, table.stdout
        # What `plan --search --calibrate-status` reads of it: the mesh's groups, m, transport.
        (tmp_path / "status.json").write_text(status.stdout)
        point = {"concurrency": 1, "completed": 1, "input_tokens": 9, "output_tokens": 8}
        bench = {"setups": [{"points": [{**point, "tpot_ms": {"p50": 50.0}}]}]}
        (tmp_path / "bench.json").write_text(json.dumps(bench))
        spec = load_spec(path)
        seen = observed(tmp_path / "bench.json", tmp_path / "status.json", spec)
        assert sum(seen.replicas) == len(replicas) and seen.m >= 1
        assert sum(map(len, seen.groups)) == sum(spec.moe_layers) * spec.num_experts
        assert seen.transport == replicas[0]["transport"]

        stats = moe_mesh(
            "stats", "--ready-file", ready, "--json"
        )  # every service's Prometheus endpoint
        assert stats.returncode == 0, stats.stderr
        summary = json.loads(stats.stdout)
        assert {s["role"] for s in summary["services"]} == {"gateway", "router", "expert"}
        assert sum(map(sum, summary["utilization"]["tokens_routed"])) == sum(
            map(sum, st["routers"][0]["tokens_routed"])
        )

        gen = moe_mesh(  # the ready file is all a client command needs to find the mesh
            "generate",
            "--ready-file",
            ready,
            "--prompt-token-ids",
            ",".join(map(str, PROMPTS[1])),
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--json",
        )
        assert gen.returncode == 0, gen.stderr
        result = json.loads(gen.stdout)
        assert (tuple(result["token_ids"]), result["finish_reason"]) == _until_eos(
            monolithic(path)[1][:8], eos
        )

        victim = mesh["experts"][0]
        os.kill(
            victim["pid"], signal.SIGKILL
        )  # a replica dies: reported, and the mesh keeps serving
        wait_until(
            lambda: "exited with code -9" in (tmp_path / "up.log").read_text(),
            timeout_s=30,
            what="the launcher to report the killed replica",
        )
        assert asyncio.run(generate_all()) == expected
        assert victim["address"] not in _status_experts(
            ready
        )  # status follows: the dead replica is gone

        # Scale a group up: the new replica registers and takes traffic; then down to one, gracefully.
        group = mesh["experts"][2]["experts"]
        grown = moe_mesh("scale", "--ready-file", ready, "--experts", group, "--replicas", "3")
        assert grown.returncode == 0, grown.stderr
        [new] = json.loads(grown.stdout)["added"]
        assert list(_status_experts(ready).values()).count(group) == 3 and new in _status_experts(
            ready
        )
        # It joins routers' placement after its first passing health check: keep the load on until then.
        deadline = time.monotonic() + 30
        while asyncio.run(_forward_calls(new)) == 0:
            assert time.monotonic() < deadline, "the new replica took no calls in 30 s"
            asyncio.run(generate_all())
        shrunk = moe_mesh("scale", "--ready-file", ready, "--experts", group, "--replicas", "1")
        assert shrunk.returncode == 0 and len(json.loads(shrunk.stdout)["removed"]) == 2, (
            shrunk.stderr
        )
        assert list(_status_experts(ready).values()).count(group) == 1
        assert asyncio.run(generate_all()) == expected
        assert (
            "exited with code 0" not in (tmp_path / "up.log").read_text()
        )  # retired on purpose: not reported
        bad = moe_mesh("scale", "--ready-file", ready, "--experts", "9:0", "--replicas", "1")
        assert bad.returncode == 2 and "layer" in bad.stderr

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        assert not any(_alive(pid) for pid in mesh["pids"].values())
        assert not ready.exists()
        # Each service flushed its spans as it stopped: a request is one trace across all three.
        files = [f for f in mesh["trace_files"] if Path(f).exists()]
        request = next(
            s for s in load_spans(map(Path, files)) if s["name"] == "moe.gateway.request"
        )
        shown = moe_mesh(
            "trace", "show", *files, "--trace-id", request["trace_id"], "--max-depth", "3"
        )
        assert shown.returncode == 0, shown.stderr
        assert "services expert, gateway, router" in shown.stdout.splitlines()[0], shown.stdout
