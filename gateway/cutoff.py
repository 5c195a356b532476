"""Ending an admitted generation from outside with an error, which its API then reports like any
other (an SSE error event, a gRPC status) instead of the connection just closing.

A shutdown whose grace period runs out cuts the generations still streaming. Each is iterated by
one task (the HTTP response's, the gRPC handler's), mostly waiting for its router's next message;
the cut cancels that wait, and the task turns the cancellation into the error, as asyncio.timeout
turns its own into TimeoutError. A generation not waiting just then gets the error at its next step.

The iterating task marks its waits with a flag rather than through a context manager or a wrapping
coroutine: either costs a few microseconds per token, the flag next to nothing.
"""

from __future__ import annotations

import asyncio


class Cutoff:
    """One generation's off switch, used as GatewayCore._stream does: it raises `error` before
    each step once it is set, sets `task` (the task about to wait) and holds `waiting` true only
    around the await for the next item, and in `except CancelledError` there raises `error`
    instead when caused_it()."""

    __slots__ = ("error", "task", "waiting", "_cancelled")

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.task: asyncio.Task | None = None
        self.waiting = False  # the task is suspended in a wait that cut() may cancel
        self._cancelled = False

    def cut(self, error: Exception) -> None:
        """End the generation with `error` (the first cut's; later ones change nothing)."""
        if self.error is not None:
            return
        self.error = error
        if self.waiting and self.task is not None:
            self._cancelled = True
            self.task.cancel()

    def caused_it(self) -> bool:
        """In `except CancelledError` around a marked wait: whether cut() alone cancelled it, so that
        `error` is to be raised instead. Takes back cut()'s cancellation request; one from elsewhere
        as well (the client left just then) keeps it a cancellation."""
        if not self._cancelled or self.task is None:
            return False
        self._cancelled = False
        return self.task.uncancel() == 0
