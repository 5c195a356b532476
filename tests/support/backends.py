"""Expert backends for dispatcher and model tests: a remote-looking one that computes the true
outputs and records what it was asked, and a clock the test moves by hand."""

from __future__ import annotations

import asyncio

import torch

from common.errors import DeadlineExceededError, UnavailableError
from router_service.experts.backends import ColocatedExperts
from router_service.experts.remote import ExpertOutputs


def hidden(spec, n: int = 24) -> torch.Tensor:
    """n rows of hidden states, the same for the same n."""
    return torch.randn(n, spec.hidden_size, generator=torch.Generator().manual_seed(n))


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recording(ColocatedExperts):
    """Computes like the colocated backend, but looks remote and records which experts it served
    and each call's timeout.

    A call takes `delay_s + per_row_s * rows`: slept on the event loop, or, given a `clock`,
    passed on that clock at once (simulated time). Past its timeout it raises
    DeadlineExceededError; `fail` makes it unreachable."""

    local = False

    def __init__(
        self,
        weights,
        fail: bool = False,
        delay_s: float = 0.0,
        per_row_s: float = 0.0,
        clock: FakeClock | None = None,
        service_s: float = 0.0,
    ) -> None:
        super().__init__(weights)
        self.fail, self.delay_s, self.per_row_s = fail, delay_s, per_row_s
        self.clock, self.service_s = clock, service_s
        self.served: list[tuple[int, int]] = []
        self.timeouts: list[float | None] = []
        self.checks = 0

    async def check(self, timeout_s):
        """A health check: fails while the backend is down (RemoteExperts.check's stand-in)."""
        self.checks += 1
        if self.fail:
            raise UnavailableError("recording backend is down")

    async def forward(self, layer, groups, timeout_s=None):
        self.outstanding += 1  # as RemoteExperts counts its calls in flight
        self.timeouts.append(timeout_s)
        try:
            delay_s = self.delay_s + self.per_row_s * sum(rows.shape[0] for _, rows in groups)
            if delay_s:
                waited = min(delay_s, timeout_s or delay_s)
                if self.clock is not None:
                    self.clock.advance(waited)
                else:
                    await asyncio.sleep(waited)
                if timeout_s is not None and delay_s > timeout_s:
                    raise DeadlineExceededError("slow backend")
            if self.fail:
                raise UnavailableError("recording backend is down")
            self.served += [(layer, e) for e, _ in groups]
            return ExpertOutputs(self.compute(layer, groups), "grpc", self.service_s)
        finally:
            self.outstanding -= 1
