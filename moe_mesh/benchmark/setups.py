"""Set-ups the benchmark starts itself: each one a `moe-mesh up` with its own flags, on loopback.

`--setup 'NAME=FLAGS'` names a set-up and the `moe-mesh up` flags that make it, e.g.
`'remote=--expert-services 4'`, `'monolithic=--expert-services 0'`,
`'grpc-only=--router-arg=--fast-path=off'`. They run one after another: started in a new session
(so a stuck one can be killed as a group, which holds only what it started), waited for through its
ready file (bounded), stopped with SIGTERM (`up` drains gateway, routers, experts in order) and
SIGKILLed after a bound.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common.errors import InvalidArgumentError, UnavailableError

READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 90.0  # `up` gives each of its three roles 20 s to drain
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


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join("    " + x for x in path.read_text().splitlines()[-lines:])
    except OSError:
        return "    (no log)"


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
    ready = here / "ready.json"
    ready.unlink(missing_ok=True)
    log_path = here / "up.log"
    argv = [
        sys.executable,
        "-m",
        "moe_mesh",
        "up",
        "--checkpoint",
        str(checkpoint),
        "--ready-file",
        str(ready),
        "--run-dir",
        str(here),
        *setup.up_args,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not ready.exists():
            if proc.poll() is not None:
                problem = (
                    f"set-up {setup.name!r}: `moe-mesh up {shlex.join(setup.up_args)}` exited with "
                    f"code {proc.returncode} (log {log_path}):\n{_tail(log_path)}"
                )
                if proc.returncode == 2:  # up refused its flags before starting anything
                    raise InvalidArgumentError("--setup", problem)
                raise UnavailableError(problem)
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"set-up {setup.name!r} not serving after {ready_timeout_s:g}s (log {log_path})"
                )
            time.sleep(0.1)
        yield ready
    finally:
        _stop(proc, stop_timeout_s)


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM `up` (it stops its children, draining); after `timeout_s`, SIGKILL its whole session.
    `up` is not reaped before the kill, so its pid (the session's id) cannot have been reused."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
