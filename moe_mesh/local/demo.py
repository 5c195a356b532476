"""`make demo`: create a checkpoint if none is given, bring the mesh up with every expert remote and
every request traced, stream a few generations through the gateway, show latency, throughput,
per-service metrics and the expert heatmap, shut everything down, and print one request's trace."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

PROMPTS = [
    ("The expert services", 0.0),
    ("Mixture-of-Experts models route each token to", 0.0),
    ("Once upon a time", 0.8),
    ("In a distributed system, the router", 0.8),
]


async def _generate_all(gateway: str, max_tokens: int) -> list[dict]:
    from moe_mesh.ops.client import generate_remote
    from protos.moe_mesh.v1 import inference_pb2

    async def one(i: int, prompt: str, temperature: float) -> dict:
        request = inference_pb2.GenerateRequest(
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i,
            request_id=f"req-{i}",
        )
        return await generate_remote(gateway, request, stream=i == 0)

    print(f"[req-0] {PROMPTS[0][0]}", end="", flush=True)
    return await asyncio.gather(*(one(i, p, t) for i, (p, t) in enumerate(PROMPTS)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="an existing checkpoint directory")
    src.add_argument(
        "--create", type=Path, help="where to create (or reuse) the demo's small Mixtral checkpoint"
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--expert-services", type=int, default=4)
    args = parser.parse_args(argv)

    from moe_mesh.dev.create_checkpoint import create_checkpoint
    from moe_mesh.local.launcher import Launcher
    from moe_mesh.local.terminal import say
    from moe_mesh.ops import stats as stats_view
    from moe_mesh.ops.client import mesh_status, print_status

    path = args.checkpoint or args.create
    if args.create and not (path / "config.json").exists():
        print(
            f"==> creating a small Mixtral checkpoint with skewed routing in {path}",
            file=sys.stderr,
        )
        create_checkpoint(path, "mixtral", "small", seed=0, router_skew=2.0, progress=True)
    else:
        print(f"==> using the checkpoint in {path}", file=sys.stderr)
    run_dir = Path(".cache") / "demo-mesh"
    for old in run_dir.glob("*.spans.jsonl"):  # spans of an earlier demo would mix with this one's
        old.unlink()
    launcher = Launcher(path, run_dir, args.expert_services, 1, 1, [], [], trace_sample=1.0)
    mesh = None
    try:
        mesh = launcher.start()
        print(
            f"==> mesh up: gateway {mesh['gateway_grpc']} (HTTP http://{mesh['gateway_http']}/v1), "
            f"router {mesh['routers'][0]}, {len(mesh['experts'])} expert services, every expert remote"
        )
        print(f"==> {len(PROMPTS)} requests through the gateway at once (streaming req-0)\n")
        start = time.perf_counter()
        results = asyncio.run(_generate_all(mesh["gateway_grpc"], args.max_tokens))
        wall = time.perf_counter() - start
        print("\n")
        for (prompt, temp), r in zip(PROMPTS, results):
            print(f"[{r['request_id']}] temp={temp} {prompt!r} -> {r['text'][:50]!r}...")
            print(
                f"         {r['usage']['completion_tokens']} tokens, finish={r['finish_reason']}, "
                f"latency {r['latency_s']:.2f}s, first token {r['time_to_first_token_s'] * 1000:.0f} ms, "
                f"{r['decode_tokens_per_s']} tok/s"
            )
        total = sum(r["usage"]["completion_tokens"] for r in results)
        print(f"\n==> {total} tokens in {wall:.2f}s: {total / wall:.1f} tokens/s aggregate\n")
        print_status(asyncio.run(mesh_status(mesh)))
        print("\n==> metrics scraped from every service's Prometheus endpoint (moe-mesh stats)\n")
        endpoints = [
            ("gateway", mesh["metrics"]["gateway"], mesh["gateway_grpc"]),
            *(("router", a, n) for a, n in zip(mesh["metrics"]["routers"], mesh["routers"])),
            *(
                ("expert", a, e["address"])
                for a, e in zip(mesh["metrics"]["experts"], mesh["experts"])
            ),
        ]
        print(stats_view.render(stats_view.collect(endpoints)))
        print(
            "\n(The checkpoint is random-initialised, so the text is gibberish; routing and timings are real.)"
        )
    finally:
        say("==> shutting the mesh down")  # never raises: a closed stdout must not skip the stop
        launcher.stop()  # each service flushes its spans as it stops
    _show_trace(mesh["trace_files"])
    print(
        f"\n==> done. To keep a mesh running and send it your own requests, see README.md, "
        f"'Try it' ({_command()} up --checkpoint {path} ...)."
    )
    return 0


def _command() -> str:
    """How to run moe-mesh from this shell: the console script of this virtualenv."""
    script = Path(sys.executable).parent / "moe-mesh"
    return str(script) if script.exists() else f"{sys.executable} -m moe_mesh"


def _show_trace(files: list[str]) -> None:
    from collections import Counter

    from moe_mesh.ops import traces as trace_view

    spans = trace_view.load_spans(Path(f) for f in files if Path(f).exists())
    # Engine steps hang under the oldest traced request in their batch: show that request's trace.
    sizes = Counter(s["trace_id"] for s in spans)
    request = max(
        (s for s in spans if s["name"] == "moe.gateway.request"), key=lambda s: sizes[s["trace_id"]]
    )
    request_id, trace_id = request["attributes"].get("gen_ai.request.id"), request["trace_id"]
    print(
        f"\n==> the trace of {request_id}: gateway -> router -> its engine steps; each step's expert "
        f"calls, down to the expert services' FFN spans, are in the full tree "
        f"({_command()} trace show {' '.join(files)} --trace-id {trace_id})\n"
    )
    print(trace_view.render_trace(spans, trace_id, max_depth=5))


if __name__ == "__main__":
    from moe_mesh.local.launcher import EXIT_BROKEN_PIPE
    from moe_mesh.local.terminal import silence_stdout

    try:
        sys.exit(main())
    except BrokenPipeError:  # `make demo | head`: the mesh is already stopped
        silence_stdout()
        sys.exit(EXIT_BROKEN_PIPE)
