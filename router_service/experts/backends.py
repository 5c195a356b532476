"""Where a layer's experts are computed: the `ExpertBackend` protocol, the colocated backend, and
the placement table (which backends serve each (layer, expert) pair) kept live as it changes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from common.moe import experts_ffn
from common.quant import precision
from common.weights import FFNWeights


class ExpertBackend(Protocol):
    """Computes expert FFNs. `groups` is [(expert, rows [n, hidden])]; returns outputs in the same order.

    Raises UnavailableError when the backend cannot be reached (the dispatcher then tries another
    replica) and DeadlineExceededError when `timeout_s` runs out. A local backend also offers
    `compute(layer, groups)`, the same without awaiting, which the dispatcher runs on the
    router's compute thread. A remote one may offer `check(timeout_s)`, a cheap call that raises
    unless the service is up and serves this router's model: while the backend is ejected the
    dispatcher calls it, and re-admits the backend once it passes.
    """

    local: bool  # True: in this process, no network hop
    outstanding: int  # calls in flight, for load balancing
    region: str  # where it runs ("" unknown); routers prefer their own region

    async def forward(
        self, layer: int, groups: Sequence[tuple[int, torch.Tensor]], timeout_s: float | None = None
    ) -> list[torch.Tensor]: ...


class ColocatedExperts:
    """Experts held in this process: no network hop."""

    local = True
    outstanding = 0
    region = ""

    def __init__(self, weights: Mapping[tuple[int, int], FFNWeights]) -> None:
        self.weights = dict(weights)

    @property
    def precision(self) -> str:
        """What the weights are held in: 'bfloat16', 'int4-g64', ... ('' with none)."""
        down = next((w.down for w in self.weights.values()), None)
        if down is None:
            return ""
        return precision(down.dtype, getattr(down, "quantization", None))

    def __repr__(self) -> str:
        return f"ColocatedExperts({len(self.weights)} experts)"

    def compute(self, layer: int, groups: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        batches = [(rows, self.weights[(layer, expert)]) for expert, rows in groups]
        device = getattr(batches[0][1].down, "device", None) if batches else None
        if device is None or device == batches[0][0].device:
            return experts_ffn(batches)
        # A GPU router's rows staged in host memory for a layer that also calls remote experts:
        # these experts' share goes to their device and back.
        outs = experts_ffn([(rows.to(device), w) for rows, w in batches])
        return [out.to(rows.device) for out, (rows, _) in zip(outs, batches)]

    async def forward(
        self, layer: int, groups: Sequence[tuple[int, torch.Tensor]], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        return self.compute(layer, groups)


Placement = Mapping[tuple[int, int], Sequence[ExpertBackend]]


class PlacementSink(Protocol):
    """What takes each new placement table (the dispatcher)."""

    def set_placement(self, placement: Placement) -> None: ...


def backend_name(backend: ExpertBackend) -> str:
    return getattr(backend, "address", repr(backend))


class LivePlacement:
    """The dispatcher's placement table, rebuilt whenever one of its two sources changes: the experts
    colocated in this process (pins and tiering) and the remote replicas (static or from the registry).

    Each change publishes a new table in one assignment, so a layer call reads a consistent table,
    and a replaced ColocatedExperts stays alive (its weights too) only while a call still holds it.
    """

    def __init__(
        self, dispatcher: PlacementSink, colocated: ColocatedExperts | None = None
    ) -> None:
        self.dispatcher = dispatcher
        self.colocated = colocated or ColocatedExperts({})
        self.remote: dict[tuple[int, int], list[ExpertBackend]] = {}
        # Called after each new table (on the thread that changed it): the router's health follows
        # which experts have a replica.
        self.listeners: list[Callable[[], None]] = []
        self._publish()

    def set_remote(self, remote: Mapping[tuple[int, int], Sequence[ExpertBackend]]) -> None:
        self.remote = {pair: list(replicas) for pair, replicas in remote.items() if replicas}
        self._publish()

    def set_colocated(self, colocated: ColocatedExperts) -> None:
        self.colocated = colocated
        self._publish()

    def _publish(self) -> None:
        table: dict[tuple[int, int], list[ExpertBackend]] = {
            pair: [self.colocated] for pair in self.colocated.weights
        }
        for pair, replicas in self.remote.items():
            table.setdefault(pair, []).extend(replicas)
        self.table = table
        self.dispatcher.set_placement(table)
        for listener in self.listeners:
            listener()

    def missing(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The pairs of `pairs` that no backend serves."""
        return [p for p in pairs if not self.table.get(p)]
