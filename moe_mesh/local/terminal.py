"""Printing to a terminal or a pipe that may close: `moe-mesh up | head -1` must stop the mesh,
not crash on its next line."""

from __future__ import annotations

import os
import select
import stat
import sys


def say(*args: object) -> bool:
    """print to stdout, flushed; False once its reader has gone (stdout then goes to /dev/null, so
    nothing later, the interpreter's exit included, trips over the closed pipe)."""
    try:
        print(*args, flush=True)
        return True
    except BrokenPipeError:
        silence_stdout()
        return False


def silence_stdout() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone, found without writing to it: a launcher that
    prints nothing while it watches must still notice `moe-mesh up | head -1` ending."""
    try:
        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            return False
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False
