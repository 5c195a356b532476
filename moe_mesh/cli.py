"""The `moe-mesh` command line. Each subcommand lives with the code it drives; this file only lists them:

serving        serve-expert, serve-router, serve-gateway   (the three services)
running local  up, scale, generate, certs                   (moe_mesh.local)
autoscaling    autoscale                                    (moe_mesh.autoscale)
operating      status, placement show, stats, trace show    (moe_mesh.ops)
benchmarking   bench                                        (moe_mesh.benchmark)
planning       profile, plan, deploy render, probe          (moe_mesh.planning)
developing     create-checkpoint                            (moe_mesh.dev)
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import sys
import typing

from common import runtime

runtime.configure()  # the console script's entry: before anything imports torch or grpc

import grpc  # noqa: E402

from common import kernel_build  # noqa: E402
from common.cli import exit_code  # noqa: E402
from common.errors import MoeMeshError, UnavailableError  # noqa: E402

# Each command -> the module and function that add it to the parser, in the order `--help` lists them.
_COMMANDS = {
    "checkpoint": ("moe_mesh.dev.create_checkpoint", "add_subcommand"),
    "generate": ("moe_mesh.local.generate_cli", "add_subcommand"),
    "serve-expert": ("expert_service.cli", "add_subcommand"),
    "serve-router": ("router_service.cli", "add_subcommand"),
    "serve-gateway": ("gateway.cli", "add_subcommand"),
    "up": ("moe_mesh.local.cli", "add_subcommands"),
    "scale": ("moe_mesh.local.cli", "add_subcommands"),
    "autoscale": ("moe_mesh.autoscale.cli", "add_subcommand"),
    "certs": ("moe_mesh.local.certs", "add_subcommand"),
    "status": ("moe_mesh.ops.client", "add_subcommand"),
    "deploy": ("moe_mesh.planning.deploy", "add_subcommand"),
    "probe": ("moe_mesh.planning.deploy", "add_probe_subcommand"),
    "plan": ("moe_mesh.planning.plan", "add_subcommand"),
    "profile": ("moe_mesh.planning.profile", "add_subcommand"),
    "sizing": ("moe_mesh.planning.sizing", "add_subcommand"),
    "placement": ("moe_mesh.ops.placement", "add_subcommand"),
    "trace": ("moe_mesh.ops.traces", "add_subcommand"),
    "stats": ("moe_mesh.ops.stats", "add_subcommand"),
    "bench": ("moe_mesh.benchmark.cli", "add_subcommand"),
}

# The commands that compute, or start what does: MOE_MESH_MAX_ISA is theirs (`status` in an
# incident works whatever it says)
_COMPUTE = {
    "checkpoint",
    "generate",
    "serve-expert",
    "serve-router",
    "up",
    "scale",
    "autoscale",
    "profile",
}


class _Parser(argparse.ArgumentParser):
    """argparse, except that a mistyped flag is reported by the command it was given to, with that
    command's usage and the flags it comes closest to. (Subcommands' parsers are of this class too:
    add_subparsers makes them of the parent's.)"""

    finished: list[argparse.ArgumentParser] = []  # innermost first: the command a line reached

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._words = list(sys.argv[1:] if args is None else args)
        parsed = super().parse_known_args(args, namespace)
        _Parser.finished.append(self)
        return parsed

    def error(self, message: str):  # type: ignore[override]
        super().error(message + self.guesses(getattr(self, "_words", [])))

    def guesses(self, words: list[str]) -> str:
        """'; --promt: did you mean --prompt?' for each word like a flag this parser lacks."""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        out = ""
        for word in (w.split("=")[0] for w in words if w.startswith("--")):
            if not any(k.startswith(word) for k in known):  # neither a flag nor its abbreviation
                for match in difflib.get_close_matches(word, known, n=1, cutoff=0.75):
                    out += f"; {word}: did you mean {match}?"
        return out


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or only `command`'s when it is one: importing all their modules
    costs ~0.5 s more than one does, on every `moe-mesh status` or `generate`."""
    parser = _Parser(
        prog="moe-mesh", description="Serve sparse MoE language models as a gRPC mesh."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    adders = [_COMMANDS[command]] if command in _COMMANDS else dict.fromkeys(_COMMANDS.values())
    for module, add in adders:
        getattr(importlib.import_module(module), add)(subparsers)
    return parser


def version() -> str:
    try:
        return importlib.metadata.version("moe-mesh")
    except importlib.metadata.PackageNotFoundError:  # a source checkout that was never installed
        return "unknown (not installed)"


def run() -> typing.NoReturn:
    """The `moe-mesh` command: main(), then exit without the interpreter's teardown
    (runtime.exit_now: a second or more after a command that imported torch)."""
    runtime.exit_now(main())


def main(argv: list[str] | None = None) -> int:
    """Exit codes, the same for every command (docs/reference/exit-codes.md): 0 done; 1 the mesh or the
    machine failed (a service died or could not start, a port is taken, a peer is unreachable, a
    request failed); 2 the command was wrong (a bad flag or value, a missing file, input refused);
    130 interrupted (Ctrl-C); 141 stdout closed (`| head`)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    parser.add_argument("--version", action="version", version=f"moe-mesh {version()}")
    _Parser.finished.clear()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the command they were given to, not by `moe-mesh` itself
        _Parser.finished[0].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command in _COMPUTE:  # refused here, not where the kernels first load (a step)
            kernel_build.max_isa()
        return args.func(args)
    except MoeMeshError as e:
        from moe_mesh.ops.hints import hint  # the fix that applies: CA, API key, scale, address

        print(f"moe-mesh {args.command}: error: {e}{hint(e)}", file=sys.stderr)
        return exit_code(e)
    except grpc.RpcError as e:  # a command's call to a service: one line, not gRPC's debug text
        print(f"moe-mesh {args.command}: error: {_rpc_problem(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        from moe_mesh.local.launcher import EXIT_BROKEN_PIPE
        from moe_mesh.local.terminal import silence_stdout

        silence_stdout()
        return EXIT_BROKEN_PIPE


def _rpc_problem(e: grpc.RpcError) -> str:
    from moe_mesh.ops.hints import hint

    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        problem = f"cannot reach the service ({code.name}: {details.splitlines()[0]})"
        return problem + hint(UnavailableError(problem))
    problem = f"{code.name if code else 'RPC failed'}: {details.splitlines()[0]}"
    return problem + hint(RuntimeError(problem))


if __name__ == "__main__":
    sys.exit(main())
