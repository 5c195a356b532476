"""`moe-mesh up` and `moe-mesh scale`: a whole mesh of processes on this machine, and its expert replicas."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from common import kernel_build
from common.cli import add_settings_arguments, flag, settings_from_args
from common.device import for_experts, is_cuda
from common.errors import InvalidArgumentError
from common.hub import resolve_checkpoint
from gateway.settings import GatewaySettings
from moe_mesh.local.checks import checkpoint_problem, device_problem, exposure
from moe_mesh.local.settings import ScaleSettings, UpSettings
from moe_mesh.ops.ready import read_ready_file
from router_service.settings import RouterSettings

# The gateway's public address (the other services take free loopback ports) and its limits.
GATEWAY_FLAGS = (
    "host",
    "grpc_port",
    "http_port",
    "served_model_name",
    "max_in_flight",
    "max_queued",
    "api_key_file",
    "max_prompts",
    "allow_unknown_fields",
    "disable_fastapi_docs",
)
ROUTER_FLAGS = ("max_num_seqs", "colocate_budget")


def _pass_through(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        if isinstance(value, bool):  # BooleanOptionalAction: --x / --no-x, no value
            out.append(flag(name) if value else "--no-" + flag(name)[2:])
            continue
        for v in value if isinstance(value, list) else [] if value is None else [value]:
            out += [flag(name), str(v)]
    return out


class _Flags(argparse.ArgumentParser):
    """A parser of flags `up` passes on, reporting a bad one as one line naming the flag that
    carried it (--router-arg, --autoscale-arg) instead of the whole usage."""

    def __init__(self, carrier: str) -> None:
        super().__init__(add_help=False)
        self.carrier = carrier

    def error(self, message: str):  # type: ignore[override]
        raise InvalidArgumentError(self.carrier, message)


def _autoscale_policy(args: argparse.Namespace):
    """--autoscale-arg's policy for every group (moe_mesh/autoscale/policy.py), starting from
    --replicas: InvalidArgumentError naming what is wrong."""
    from moe_mesh.autoscale.policy import Autoscale

    parser = _Flags("--autoscale-arg")
    add_settings_arguments(parser, Autoscale)
    given = parser.parse_args(_words("--autoscale-arg", args.autoscale_arg))
    try:
        policy = settings_from_args(Autoscale, given)
    except InvalidArgumentError as e:
        raise InvalidArgumentError("--autoscale-arg", str(e)) from None
    if problem := policy.problem():
        raise InvalidArgumentError("--autoscale-arg", problem)
    if not policy.min_replicas <= args.replicas <= policy.max_replicas:
        raise InvalidArgumentError(
            "--replicas",
            f"{args.replicas} is outside the autoscaler's [{policy.min_replicas}, "
            f"{policy.max_replicas}] (--autoscale-arg='--min-replicas N --max-replicas M')",
        )
    return policy


def _words(flag: str, texts: list[str]) -> list[str]:
    """Each of `flag`'s values split as a shell splits it (an unclosed quote names the flag)."""
    try:
        return [word for text in texts for word in shlex.split(text)]
    except ValueError as e:
        raise InvalidArgumentError(flag, f"{e} in {texts!r}") from None


def _check_flags(args: argparse.Namespace, router_args: list[str]) -> str | None:
    """The first problem with the flags, before any process starts (a child would find it late)."""
    if args.certs_dir is not None and not args.tls:
        return "--certs-dir needs --tls"
    if args.grpc_port and args.grpc_port == args.http_port:
        return f"--grpc-port and --http-port are both {args.grpc_port}: the gateway needs two ports"
    if not (args.checkpoint / "config.json").is_file():
        return f"--checkpoint: {args.checkpoint} has no config.json (not a checkpoint directory)"
    if problem := checkpoint_problem(args.checkpoint):
        return problem
    config = json.loads((args.checkpoint / "config.json").read_text())
    dtype = config.get("torch_dtype") or config.get("dtype")
    if args.quantize != "none" and dtype != "bfloat16":
        return (
            f"--quantize {args.quantize}: quantized experts compute with bfloat16 activations, "
            f"and a local mesh computes in the checkpoint's dtype, {dtype} (a bfloat16 one: "
            "`moe-mesh checkpoint create --dtype bfloat16`, or a published model)"
        )
    if args.quantize != "none" and kernel_build.max_isa() == 0:
        return f"--quantize {args.quantize}: quantized experts need the C kernels (MOE_MESH_MAX_ISA=none)"
    from router_service import cli as router_cli

    # Every router flag, --router-arg's included, through the router's own parser and settings.
    parser = _Flags("--router-arg")
    router_cli.add_arguments(parser)
    gateway = argparse.Namespace(
        checkpoint=args.checkpoint, **{n: getattr(args, n) for n in GATEWAY_FLAGS}
    )
    try:
        router, unknown = parser.parse_known_args(
            ["--checkpoint", str(args.checkpoint), *router_args]
        )
        if unknown:
            return f"--router-arg: unknown router flag(s) {' '.join(unknown)}"
        settings_from_args(GatewaySettings, gateway)
        router_device = settings_from_args(RouterSettings, router, flags=router_cli.FLAGS).device
    except InvalidArgumentError as e:
        return str(e)
    return _devices_problem(args, router_device)


def _devices_problem(args: argparse.Namespace, router_device: str) -> str | None:
    """A GPU asked for (by --device, --expert-device or a --router-arg) that torch cannot see
    here, or quantized experts asked for on one (they compute on CPUs only)."""
    holder, experts = (
        ("--expert-device" if args.expert_device else "--device", _expert_device(args))
        if args.expert_services
        else ("--device" if router_device == args.device else "--router-arg", router_device)
    )
    if args.quantize != "none" and is_cuda(experts):
        return (
            f"--quantize {args.quantize}: quantized experts compute on CPUs only, and {holder} "
            f"puts them on {experts}"
        )
    named = [("--device", args.device), ("--router-arg", router_device)]
    if args.expert_services and args.expert_device:
        named.append(("--expert-device", args.expert_device))
    for flag_name, device in named:
        if problem := device_problem(flag_name, device):
            return problem
    return None


def _expert_device(args: argparse.Namespace) -> str:
    """The expert services' --device: --expert-device, else --device; auto is the CPU for
    quantized experts, which compute there only."""
    return for_experts(args.expert_device or args.device, args.quantize != "none")


def _taken_port(args: argparse.Namespace) -> str | None:
    """A fixed gateway port something already listens on (the gateway binds it again later)."""
    from common.server import listen_socket

    host = args.host or GatewaySettings.model_fields["host"].default
    for name, port in (("--grpc-port", args.grpc_port), ("--http-port", args.http_port)):
        if port:
            try:
                listen_socket(host, port, f"the gateway ({name})").close()
            except OSError as e:
                return str(e)
    return None


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    _add_up(subparsers)
    _add_scale(subparsers)


def _add_up(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start a whole mesh on this machine",
        description="Start expert services, router(s) and the gateway as separate "
        "processes on loopback; Ctrl-C or SIGTERM stops them all.",
    )
    add_settings_arguments(p, UpSettings)
    # Passed through to the gateway and routers: declared once, by their settings models.
    add_settings_arguments(p, GatewaySettings, only=GATEWAY_FLAGS)
    add_settings_arguments(p, RouterSettings, only=ROUTER_FLAGS)
    p.set_defaults(func=_run_up)


def _settings(model: type, args: argparse.Namespace, required: list[str], command: str):
    """`args` with `model`'s fields validated and defaulted; None (an error printed) if invalid."""
    try:
        settings = settings_from_args(model, args, required=required)
    except InvalidArgumentError as e:
        print(f"moe-mesh {command}: error: {e}", file=sys.stderr)
        return None
    return argparse.Namespace(**{**vars(args), **settings.model_dump()})


def _run_up(args: argparse.Namespace) -> int:
    import time as _time

    from moe_mesh.local.launcher import run_up

    args = _settings(UpSettings, args, ["checkpoint"], "up")
    if args is None:
        return 2

    gateway_args = _pass_through(args, GATEWAY_FLAGS)
    try:
        # --device before --router-arg's words: a --device among them is the later, and wins.
        router_args = [
            *_pass_through(args, ROUTER_FLAGS),
            *_pass_through(args, ("device",)),
            *_words("--router-arg", args.router_arg),
        ]
    except InvalidArgumentError as e:
        print(f"moe-mesh up: error: {e}", file=sys.stderr)
        return 2
    quantize = _pass_through(args, ("quantize", "quantize_group_size"))
    expert_args = [*quantize, "--device", _expert_device(args)]
    if not args.expert_services:  # the routers hold every expert
        router_args, expert_args = quantize + router_args, []
    # Absolute: the ready file names files under it (certificates, logs, spans) that client
    # commands read from wherever they run.
    run_dir = (
        args.run_dir or Path(".cache") / f"mesh-{_time.strftime('%Y%m%d-%H%M%S')}"
    ).absolute()
    args.checkpoint = resolve_checkpoint(args.checkpoint)  # an HF model id: its cached snapshot
    problem = _check_flags(args, router_args)
    if not problem and args.autoscale_arg and not args.autoscale:
        problem = "--autoscale-arg needs --autoscale"
    if not problem and args.expert_services == 0 and args.expert_device:
        problem = "--expert-device places expert services, and --expert-services 0 runs none"
    if not problem and args.expert_services == 0 and args.autoscale:
        problem = "--autoscale scales expert services, and --expert-services 0 runs none"
    try:
        autoscale = _autoscale_policy(args) if args.autoscale and not problem else None
    except InvalidArgumentError as e:
        problem = str(e)
    if problem:
        print(f"moe-mesh up: error: {problem}", file=sys.stderr)
        return 2
    if problem := _taken_port(args):  # found now rather than after every other service started
        print(f"moe-mesh up: error: {problem}", file=sys.stderr)
        return 1
    if warning := exposure(args.host, args.tls, args.api_key_file):
        print(f"moe-mesh up: warning: {warning}", file=sys.stderr)
    return run_up(
        args.checkpoint,
        args.expert_services,
        args.replicas,
        args.routers,
        args.ready_file,
        run_dir,
        gateway_args,
        router_args,
        args.trace_sample,
        (args.certs_dir or run_dir / "certs").absolute() if args.tls else None,
        expert_args,
        autoscale,
    )


def _add_scale(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "scale",
        help="add or remove expert-service processes of a running local mesh",
        description="Run exactly --replicas expert-service processes serving --experts "
        "in a mesh started by `moe-mesh up` (0 removes them; refused, exit 2, while the "
        "replicas it would stop are the only copy of some expert, unless --force).",
    )
    add_settings_arguments(p, ScaleSettings)
    p.set_defaults(func=_run_scale)


def _run_scale(args: argparse.Namespace) -> int:
    import socket

    args = _settings(ScaleSettings, args, ["ready_file", "experts", "replicas"], "scale")
    if args is None:
        return 2

    host, _, port = read_ready_file(args.ready_file, "control")["control"].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=300) as conn:
        conn.sendall(
            (
                json.dumps(
                    {"experts": args.experts, "replicas": args.replicas, "force": args.force}
                )
                + "\n"
            ).encode()
        )
        reply = json.loads(conn.makefile().readline())
    if "error" in reply:
        print(f"moe-mesh scale: error: {reply['error']}", file=sys.stderr)
        return 2
    print(json.dumps(reply))
    return 0
