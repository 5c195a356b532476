"""`make demo`: create a checkpoint if none is given, bring the mesh up with every expert remote,
stream a few generations through the gateway, show latency, throughput and where tokens went,
then shut everything down."""

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
    from moe_mesh.client import generate_remote
    from protos.moe_mesh.v1 import inference_pb2

    async def one(i: int, prompt: str, temperature: float) -> dict:
        request = inference_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                                seed=i, request_id=f"req-{i}")
        return await generate_remote(gateway, request, stream=i == 0)

    print(f"[req-0] {PROMPTS[0][0]}", end="", flush=True)
    return await asyncio.gather(*(one(i, p, t) for i, (p, t) in enumerate(PROMPTS)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="an existing checkpoint directory")
    src.add_argument("--create", type=Path, help="where to create (or reuse) the demo's small Mixtral checkpoint")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--expert-services", type=int, default=4)
    args = parser.parse_args(argv)

    from moe_mesh.client import mesh_status, print_status
    from moe_mesh.create_checkpoint import create_checkpoint
    from moe_mesh.launcher import Launcher

    path = args.checkpoint or args.create
    if args.create and not (path / "config.json").exists():
        print(f"==> creating a small Mixtral checkpoint with skewed routing in {path}", file=sys.stderr)
        create_checkpoint(path, "mixtral", "small", seed=0, router_skew=2.0, progress=True)
    launcher = Launcher(path, Path(".cache") / "demo-mesh", args.expert_services, 1, 1, [], [])
    try:
        mesh = launcher.start()
        print(f"==> mesh up: gateway {mesh['gateway_grpc']} (HTTP http://{mesh['gateway_http']}/v1), "
              f"router {mesh['routers'][0]}, {len(mesh['experts'])} expert services, every expert remote")
        print(f"==> {len(PROMPTS)} requests through the gateway at once (streaming req-0)\n")
        start = time.perf_counter()
        results = asyncio.run(_generate_all(mesh["gateway_grpc"], args.max_tokens))
        wall = time.perf_counter() - start
        print("\n")
        for (prompt, temp), r in zip(PROMPTS, results):
            print(f"[{r['request_id']}] temp={temp} {prompt!r} -> {r['text'][:50]!r}...")
            print(f"         {r['usage']['completion_tokens']} tokens, finish={r['finish_reason']}, "
                  f"latency {r['latency_s']:.2f}s, first token {r['time_to_first_token_s'] * 1000:.0f} ms, "
                  f"{r['decode_tokens_per_s']} tok/s")
        total = sum(r["usage"]["completion_tokens"] for r in results)
        print(f"\n==> {total} tokens in {wall:.2f}s: {total / wall:.1f} tokens/s aggregate\n")
        print_status(asyncio.run(mesh_status(mesh)))
        print("\n(The checkpoint is random-initialised, so the text is gibberish; routing and timings are real.)")
        return 0
    finally:
        print("==> shutting the mesh down")
        launcher.stop()


if __name__ == "__main__":
    sys.exit(main())
