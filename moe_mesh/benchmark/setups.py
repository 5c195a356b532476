"""Set-ups the benchmark starts itself: each one a `moe-mesh up` with its own flags, on loopback.

`--setup 'NAME=FLAGS'` names a set-up and the `moe-mesh up` flags that make it, e.g.
`'remote=--expert-services 4'`, `'monolithic=--expert-services 0'`,
`'grpc-only=--router-arg=--fast-path=off'`. They run one after another, each through
moe_mesh/local/processes.py's `running_up` (a session of its own, its ready file waited for, SIGTERM
then its whole group SIGKILLed after a bound).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from common.errors import InvalidArgumentError, UnavailableError
from moe_mesh.local.processes import READY_TIMEOUT_S, STOP_TIMEOUT_S, UpExited, running_up

RESERVED = ("--checkpoint", "--ready-file", "--run-dir")  # the benchmark sets these itself


@dataclass(frozen=True)
class Setup:
    name: str
    up_args: tuple[str, ...] = ()


def parse_setup(text: str) -> Setup:
    """'NAME=FLAGS' → Setup; InvalidArgumentError names what is wrong."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not name or not all(c.isalnum() or c in "._-" for c in name):
        raise InvalidArgumentError(
            "--setup", f"expected NAME=FLAGS with NAME of letters, digits, . _ -; got {text!r}"
        )
    try:
        args = tuple(shlex.split(flags))
    except ValueError as e:
        raise InvalidArgumentError("--setup", f"{name}: {e}") from None
    taken = [a for a in args if a.split("=")[0] in RESERVED]
    if taken:
        raise InvalidArgumentError(
            "--setup", f"{name}: {', '.join(taken)} is set by the benchmark (use --checkpoint)"
        )
    return Setup(name, args)


@contextmanager
def started(
    setup: Setup,
    checkpoint: Path,
    run_dir: Path,
    ready_timeout_s: float = READY_TIMEOUT_S,
    stop_timeout_s: float = STOP_TIMEOUT_S,
) -> Iterator[Path]:
    """Run `moe-mesh up` for `setup` and yield its ready file (the endpoints, and a `--tls` mesh's
    certificates) once the whole mesh serves; stop it on the way out. Its logs go to run_dir/NAME/."""
    here = run_dir / setup.name
    here.mkdir(parents=True, exist_ok=True)
    mesh = running_up(
        checkpoint, setup.up_args, ready_file=here / "ready.json", run_dir=here,
        log_path=here / "up.log", ready_timeout_s=ready_timeout_s, stop_timeout_s=stop_timeout_s,
    )  # fmt: skip
    with ExitStack() as stack:  # stops the mesh on the way out
        try:
            ready = stack.enter_context(mesh).ready_file
        except UpExited as e:  # named after the set-up; the benchmark's own errors pass untouched
            if e.returncode == 2:  # up refused its flags before starting anything
                raise InvalidArgumentError("--setup", f"set-up {setup.name!r}: {e}") from None
            raise UpExited(f"set-up {setup.name!r}: {e}", e.returncode) from None
        except UnavailableError as e:
            raise UnavailableError(f"set-up {setup.name!r}: {e}") from None
        yield ready
