"""`moe-mesh serve-router` (also `python -m router_service`): one router process."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from common.errors import MoeMeshError
from common.telemetry import add_telemetry_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, type=Path, help="HuggingFace-layout checkpoint directory")
    p.add_argument("--expert", dest="expert_endpoints", action="append", default=[], metavar="HOST:PORT",
                   help="an expert service to use (repeatable); what it serves is learned from its Describe RPC")
    p.add_argument("--registry", default="none", choices=["none", "consul"],
                   help="'consul': follow expert services live through Consul (CONSUL_HTTP_ADDR) or the "
                        "embedded registry of `moe-mesh up`, and register this router")
    p.add_argument("--registry-address", default=None, help="Consul HTTP address (default CONSUL_HTTP_ADDR)")
    p.add_argument("--advertise-host", default=None, help="address registered for gateways to dial")
    p.add_argument("--colocate", default="", help="expert spec computed in the router, e.g. '*:0,1' "
                   "(default: none when --expert is given, else every expert)")
    p.add_argument("--colocate-budget", default=None, metavar="SIZE",
                   help="bytes of expert weights to colocate by measured utilization, re-tiered live: '512MiB', "
                        "'2GB' or a share of all routed experts like '25%%' (default 0: tiering off)")
    p.add_argument("--pin-remote", default=None, metavar="SPEC", help="expert spec tiering never colocates")
    p.add_argument("--tier-interval-s", type=float, default=None, help="seconds between tiering decisions (default 5)")
    p.add_argument("--tier-window-s", type=float, default=None, help="utilization window in seconds (default 60)")
    p.add_argument("--tier-min-dwell-s", type=float, default=None,
                   help="an expert stays at least this long in a tier it moved to (default 30)")
    p.add_argument("--region", default=None, help="this router's region; it prefers expert services of its region")
    p.add_argument("--region-penalty", type=float, default=None,
                   help="a replica in another region counts as this many more calls in flight (default 8)")
    p.add_argument("--model-id", default=None, help="model id shared with expert services (default: checkpoint dir name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences in the running batch at most")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per sequence at most")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--compute-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's, all cores); lower it when sharing a host")
    p.add_argument("--expert-timeout-s", type=float, default=30.0, help="upper bound of one expert call")
    p.add_argument("--connect-timeout-s", type=float, default=30.0, help="wait this long for expert services")
    p.add_argument("--expert-call-timeout-min-s", type=float, default=None,
                   help="the per-call timeout learned from a replica's latency is at least this (default 1)")
    p.add_argument("--hedge-min-delay-s", type=float, default=None,
                   help="hedge an expert call to another replica no earlier than this (default 0.05)")
    p.add_argument("--ready-file", type=Path, default=None, help="write {address, pid} as JSON here once serving")
    add_telemetry_arguments(p)


def run(args: argparse.Namespace) -> int:
    import uvloop
    from pydantic import ValidationError

    from common.server import serve_until_signal
    from router_service.app import RouterApp
    from router_service.settings import RouterSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    fields = set(RouterSettings.model_fields)
    try:
        settings = RouterSettings(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    except ValidationError as e:
        print(f"moe-mesh serve-router: error: {e}", file=sys.stderr)
        return 2

    if settings.compute_threads:
        import torch

        torch.set_num_threads(settings.compute_threads)

    async def main() -> None:
        app = await RouterApp.create(settings)
        app.start_core()  # keeps stepping while the server drains in-flight streams on shutdown
        try:
            await serve_until_signal(app.server, args.ready_file,
                                     {"service": "router", "metrics": app.telemetry.metrics_address})
        finally:
            await app.stop()

    try:
        uvloop.run(main())
    except (MoeMeshError, OSError) as e:  # no expert service, mismatched weights, port in use
        print(f"moe-mesh serve-router: error: {e}", file=sys.stderr)
        return 2
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve-router", help="run one router service",
                              description="Serve the model's dense part and dispatch experts to expert services.")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router_service", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
