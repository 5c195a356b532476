"""Where a remote MoE layer's time goes: the layer as the router sees it, each call to an expert
service, and each service's own FFN time (its `moe.expert.compute.duration` from /metrics), over
gRPC and over UCX, next to the same layer colocated. Small preset, 4 expert services.

    .venv/bin/python -m bench.dispatch_profile [--tokens 32 256] [--repeats 60]

(from the checkout root). When a service's FFN time per layer is about the whole remote layer, the
layer is waiting on compute, not on the transport.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import runtime

runtime.configure(shares_cores=True)  # a mesh on this host: before torch loads OpenMP
import torch  # noqa: E402
import uvloop  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, ensure_checkpoint, parse_settings  # noqa: E402
from moe_mesh.benchmark.metrics import samples, total  # noqa: E402
from moe_mesh.local.processes import start_experts  # noqa: E402
from router_service.build import build_local_engine, build_router  # noqa: E402
from router_service.experts.remote import RemoteExperts  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPUTE = "moe_expert_compute_duration_seconds_sum"


async def layer_ms(dispatcher, weights, x: torch.Tensor, repeats: int) -> float:
    for _ in range(5):  # warm channels, fast paths and page in weights
        await dispatcher.moe_layer(0, x, weights)
    start = time.perf_counter()
    for _ in range(repeats):
        await dispatcher.moe_layer(0, x, weights)
    return (time.perf_counter() - start) / repeats * 1e3


async def profile(args: ScriptSettings) -> list[dict]:
    specs = [f"*:{2 * i}-{2 * i + 1}" for i in range(4)]
    experts = start_experts(
        args.checkpoint, specs, Path(tempfile.mkdtemp(prefix="moe-profile-")), "--metrics-port", "0"
    )
    calls_ms: list[float] = []
    forward = RemoteExperts.forward

    async def timed(self, *a, **k):
        start = time.perf_counter()
        try:
            return await forward(self, *a, **k)
        finally:
            calls_ms.append((time.perf_counter() - start) * 1e3)

    RemoteExperts.forward = timed  # this process only: the bench's own router
    rows = []
    try:
        local = build_local_engine(RouterSettings(checkpoint=args.checkpoint))
        meshes = {
            t: await build_router(
                RouterSettings(
                    checkpoint=args.checkpoint,
                    expert_endpoints=[e.address for e in experts],
                    fast_path=mode,
                )
            )
            for t, mode in (("grpc", "off"), ("ucx", "ucx"))
        }
        for n in args.tokens:
            x = torch.randn(
                n, local.model.spec.hidden_size, generator=torch.Generator().manual_seed(n)
            )
            row = {
                "tokens": n,
                "colocated_layer_ms": await layer_ms(
                    local.model.dispatcher, local.model.weights.layers[0], x, args.repeats
                ),
            }
            for t, parts in meshes.items():
                model = parts.engine.model
                before = [total(samples(e.ready["metrics"]), COMPUTE) for e in experts]
                calls_ms.clear()
                row[f"{t}_layer_ms"] = await layer_ms(
                    model.dispatcher, model.weights.layers[0], x, args.repeats
                )
                after = [total(samples(e.ready["metrics"]), COMPUTE) for e in experts]
                row[f"{t}_call_p50_ms"] = statistics.median(calls_ms)
                # Includes the 5 warm-up layers' compute: a slight overstatement.
                row[f"{t}_service_ffn_ms_per_layer"] = [
                    (a - b) * 1e3 / (args.repeats + 5) for a, b in zip(after, before)
                ]
            rows.append(row)
            print(
                f"{n:>3} tokens: colocated layer {row['colocated_layer_ms']:.2f} ms | "
                + " | ".join(
                    f"{t}: layer {row[f'{t}_layer_ms']:.2f} ms, call p50 {row[f'{t}_call_p50_ms']:.2f} ms, "
                    f"each service's FFN {', '.join(f'{v:.1f}' for v in row[f'{t}_service_ffn_ms_per_layer'])} ms"
                    for t in meshes
                ),
                flush=True,
            )
        for parts in meshes.values():
            for r in parts.remotes:
                await r.close()
    finally:
        RemoteExperts.forward = forward
        for e in experts:
            e.stop()
    return rows


class Settings(ScriptSettings):
    checkpoint: Path = Field(
        ROOT / ".cache/bench-small-mixtral",
        description="checkpoint; the small Mixtral is created if missing",
    )
    out: Path = Field(ROOT / "bench/results/dispatch_profile.json", description="the JSON result")
    tokens: list[int] = Field([32, 256], description="tokens per MoE layer call")
    repeats: int = Field(60, ge=1, description="calls timed per size")


def main() -> int:
    args = parse_settings(Settings, __doc__)
    ensure_checkpoint(args.checkpoint)
    rows = uvloop.run(profile(args))  # the router's loop (mesh_dispatch.run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rows": rows, "torch_threads": torch.get_num_threads()}, indent=2)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
