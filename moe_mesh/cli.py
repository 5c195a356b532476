"""The `moe-mesh` command line: checkpoint creation and generation (more subcommands join per service)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from common import runtime
from common.errors import MoeMeshError

runtime.configure()  # the console script's entry: before anything imports torch


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt",
                              description="Generate with a running mesh (--gateway) or in this process (--local).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--gateway", metavar="HOST:PORT", help="the gateway's gRPC address of a running mesh")
    where.add_argument("--local", action="store_true", help="run the engine in this process (needs --checkpoint)")
    p.add_argument("--checkpoint", help="HuggingFace-layout checkpoint directory (with --local)")
    p.add_argument("--priority", type=int, default=0, help="higher is served first (with --gateway)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-token-ids", type=_token_ids, help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most (default 16)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 disables")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-ids", type=_token_ids, default=[], help="comma-separated stop token ids")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                   help="compute dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    if args.gateway:
        return _run_generate_remote(args)
    if not args.checkpoint:
        print("moe-mesh generate: error: --local needs --checkpoint", file=sys.stderr)
        return 2
    from common.tokenizer import Tokenizer
    from moe_mesh.local import LocalRequest, generate_local
    from router_service.build import build_local_engine
    from router_service.sampling import SamplingParams
    from router_service.settings import RouterSettings

    engine = build_local_engine(RouterSettings(checkpoint=args.checkpoint, dtype=args.dtype))
    tokenizer = Tokenizer(args.checkpoint)
    ids = args.prompt_token_ids if args.prompt is None else tokenizer.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop_token_ids=tuple(args.stop_token_ids),
                            ignore_eos=args.ignore_eos)
    request = LocalRequest("cli-0", ids, params, tuple(args.stop))

    def stream(_: str, delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    [result] = asyncio.run(generate_local(engine, tokenizer, [request], None if args.json else stream))
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"\n[{result.finish_reason}] {len(result.token_ids)} tokens in {result.latency_s:.2f}s", file=sys.stderr)
    return 0


def _run_generate_remote(args: argparse.Namespace) -> int:
    from moe_mesh.client import generate_remote
    from protos.moe_mesh.v1 import inference_pb2

    request = inference_pb2.GenerateRequest(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        stop=args.stop, stop_token_ids=args.stop_token_ids, priority=args.priority)
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        request.prompt_token_ids.extend(args.prompt_token_ids)
    if args.seed is not None:
        request.seed = args.seed
    if args.ignore_eos:
        print("moe-mesh generate: error: --ignore-eos is only available with --local", file=sys.stderr)
        return 2
    result = asyncio.run(generate_remote(args.gateway, request, stream=not args.json))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\n[{result['finish_reason']}] {len(result['token_ids'])} tokens in {result['latency_s']:.2f}s",
              file=sys.stderr)
    return 0


def _add_up(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start a whole mesh on this machine",
                              description="Start expert services, router(s) and the gateway as separate "
                                          "processes on loopback; Ctrl-C or SIGTERM stops them all.")
    p.add_argument("--checkpoint", required=True, type=Path, help="HuggingFace-layout checkpoint directory")
    p.add_argument("--expert-services", type=int, default=4, help="expert groups, each its own service (default 4)")
    p.add_argument("--replicas", type=int, default=1, help="replicas of every expert group (default 1)")
    p.add_argument("--routers", type=int, default=1, help="router replicas (default 1)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write the endpoints (gateway_grpc, gateway_http, routers, experts) as JSON here")
    p.add_argument("--run-dir", type=Path, default=None, help="where child logs go (default .cache/mesh-<time>)")
    p.add_argument("--max-queued", type=int, default=None, help="gateway admission queue size")
    p.add_argument("--max-in-flight", type=int, default=None, help="gateway requests in flight at most")
    p.add_argument("--max-num-seqs", type=int, default=None, help="router batch size at most")
    p.add_argument("--colocate-budget", default=None, metavar="SIZE",
                   help="routers colocate their hottest experts up to this many bytes, e.g. '25%%' of all "
                        "routed experts or '512MiB' (default: none, every expert remote)")
    p.add_argument("--trace-sample", type=float, default=None, metavar="RATIO",
                   help="trace this share of requests (0-1) into RUN_DIR/<service>.spans.jsonl, for `moe-mesh "
                        "trace show` (default: no traces; OTLP export follows the OTEL_* variables)")
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    import time as _time

    from moe_mesh.launcher import run_up

    gateway_args = [f for flag, v in (("--max-queued", args.max_queued), ("--max-in-flight", args.max_in_flight))
                    if v is not None for f in (flag, str(v))]
    router_args = [f for flag, v in (("--max-num-seqs", args.max_num_seqs), ("--colocate-budget", args.colocate_budget))
                   if v is not None for f in (flag, str(v))]
    run_dir = args.run_dir or Path(".cache") / f"mesh-{_time.strftime('%Y%m%d-%H%M%S')}"
    if args.trace_sample is not None and not 0 <= args.trace_sample <= 1:
        print(f"moe-mesh up: error: --trace-sample must be in [0, 1], got {args.trace_sample}", file=sys.stderr)
        return 2
    return run_up(args.checkpoint, args.expert_services, args.replicas, args.routers, args.ready_file,
                  run_dir, gateway_args, router_args, args.trace_sample)


def _add_scale(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("scale", help="add or remove expert-service processes of a running local mesh",
                              description="Run exactly --replicas expert-service processes serving --experts "
                                          "in a mesh started by `moe-mesh up` (0 removes them).")
    p.add_argument("--ready-file", type=Path, required=True, help="the file `moe-mesh up --ready-file` wrote")
    p.add_argument("--experts", required=True, help="expert spec of the group, e.g. '*:0-1'")
    p.add_argument("--replicas", type=int, required=True, help="processes that should serve it (>= 0)")
    p.set_defaults(func=_run_scale)


def _run_scale(args: argparse.Namespace) -> int:
    import socket

    if not args.ready_file.exists():
        print(f"moe-mesh scale: error: {args.ready_file} does not exist (is the mesh up?)", file=sys.stderr)
        return 2
    host, _, port = json.loads(args.ready_file.read_text())["control"].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=300) as conn:
        conn.sendall((json.dumps({"experts": args.experts, "replicas": args.replicas}) + "\n").encode())
        reply = json.loads(conn.makefile().readline())
    if "error" in reply:
        print(f"moe-mesh scale: error: {reply['error']}", file=sys.stderr)
        return 2
    print(json.dumps(reply))
    return 0


def _add_status(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="health, experts and load of a running mesh",
                              description="Query every service of a mesh started by `moe-mesh up`.")
    p.add_argument("--ready-file", type=Path, required=True, help="the file `moe-mesh up --ready-file` wrote")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from moe_mesh.client import mesh_status, print_status

    if not args.ready_file.exists():
        print(f"moe-mesh status: error: {args.ready_file} does not exist (is the mesh up?)", file=sys.stderr)
        return 2
    status = asyncio.run(mesh_status(json.loads(args.ready_file.read_text())))
    if args.json:
        print(json.dumps(status))
    else:
        print_status(status)
    healthy = [s["health"] for s in [status["gateway"], *status["routers"], *status["experts"]]]
    return 0 if all(h == "SERVING" for h in healthy) else 1


def build_parser() -> argparse.ArgumentParser:
    from expert_service import cli as expert_cli
    from gateway import cli as gateway_cli
    from moe_mesh import create_checkpoint, deploy
    from moe_mesh import plan_cli
    from moe_mesh import placement_view
    from moe_mesh import stats_view, trace_view
    from router_service import cli as router_cli

    parser = argparse.ArgumentParser(prog="moe-mesh", description="Serve sparse MoE language models as a gRPC mesh.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    create_checkpoint.add_subcommand(subparsers)
    _add_generate(subparsers)
    expert_cli.add_subcommand(subparsers)
    router_cli.add_subcommand(subparsers)
    gateway_cli.add_subcommand(subparsers)
    _add_up(subparsers)
    _add_status(subparsers)
    _add_scale(subparsers)
    deploy.add_subcommand(subparsers)
    deploy.add_probe_subcommand(subparsers)
    plan_cli.add_subcommand(subparsers)
    placement_view.add_subcommand(subparsers)
    trace_view.add_subcommand(subparsers)
    stats_view.add_subcommand(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MoeMeshError as e:
        print(f"moe-mesh: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
