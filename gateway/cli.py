"""`moe-mesh serve-gateway` (also `python -m gateway`): the public gRPC + OpenAI HTTP edge."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from common.errors import MoeMeshError
from common.telemetry import add_telemetry_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory (for the tokenizer)")
    p.add_argument("--router", dest="routers", action="append", default=[], metavar="HOST:PORT",
                   help="a router replica (repeatable); requests go to the healthy one with the fewest in flight")
    p.add_argument("--registry", default="none", choices=["none", "consul"],
                   help="'consul': follow router replicas live through Consul (CONSUL_HTTP_ADDR) or the "
                        "embedded registry of `moe-mesh up`")
    p.add_argument("--registry-address", default=None, help="Consul HTTP address (default CONSUL_HTTP_ADDR)")
    p.add_argument("--host", default="127.0.0.1", help="address both APIs bind (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=0, help="public gRPC port; 0 picks a free one")
    p.add_argument("--http-port", type=int, default=0, help="OpenAI-compatible HTTP port; 0 picks a free one")
    p.add_argument("--max-in-flight", type=int, default=64, help="requests streaming from routers at once")
    p.add_argument("--max-queued", type=int, default=64,
                   help="requests waiting for an in-flight place; beyond it: RESOURCE_EXHAUSTED / HTTP 429")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of requests that bring none")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest HTTP body (else 413) and public gRPC message (default 4 MiB)")
    p.add_argument("--router-attempts", type=int, default=None,
                   help="router calls per request at most, failovers included (default 3)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write {address, http_address, pid} as JSON here once serving")
    add_telemetry_arguments(p)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from common.server import serve_until_signal
    from gateway.app import GatewayApp
    from gateway.settings import GatewaySettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    fields = set(GatewaySettings.model_fields)
    settings = GatewaySettings(**{k: v for k, v in vars(args).items() if k in fields and v is not None})

    async def main() -> None:
        app = await GatewayApp.create(settings)
        # The HTTP address is known only once uvicorn has bound, which happens inside start().
        info = {"service": "gateway", "http_address": "", "metrics": app.telemetry.metrics_address}
        app.grpc.on_ready.append(lambda: _fill(info, app))
        try:
            await serve_until_signal(app.grpc, args.ready_file, info)
        finally:
            await app.stop()

    try:
        uvloop.run(main())
    except (MoeMeshError, OSError) as e:
        print(f"moe-mesh serve-gateway: error: {e}", file=sys.stderr)
        return 2
    return 0


async def _fill(info: dict, app) -> None:
    info["http_address"] = app.http_address


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve-gateway", help="run the public gRPC + OpenAI HTTP gateway",
                              description="Serve moe_mesh.v1.Inference and the OpenAI-compatible HTTP API "
                                          "in front of router replicas.")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
