"""Colocated experts compute each group's FFN; the live placement table lists the colocated
backend first and follows both of its sources."""

from __future__ import annotations

import torch

from common.checkpoint import Checkpoint
from common.moe import expert_ffn
from router_service.experts.backends import ColocatedExperts, LivePlacement


class Sink:
    def __init__(self) -> None:
        self.tables: list[dict] = []

    def set_placement(self, placement) -> None:
        self.tables.append(placement)


def test_colocated_experts_compute_each_group_with_its_expert(checkpoint) -> None:
    ckpt = Checkpoint(checkpoint("mixtral"))
    weights = ckpt.load_experts(ckpt.all_expert_pairs())
    rows = [torch.randn(n, ckpt.spec.hidden_size) for n in (1, 3)]
    out = ColocatedExperts(weights).compute(1, [(0, rows[0]), (2, rows[1])])
    assert torch.equal(out[0], expert_ffn(rows[0], weights[(1, 0)]))
    assert torch.equal(out[1], expert_ffn(rows[1], weights[(1, 2)]))


def test_live_placement_publishes_colocated_first_then_remote_replicas() -> None:
    sink, a, b = Sink(), object(), object()
    here = ColocatedExperts({(0, 0): None, (0, 1): None})
    live = LivePlacement(sink, here)
    assert sink.tables[-1] == {(0, 0): [here], (0, 1): [here]}
    live.set_remote({(0, 1): [a, b], (0, 2): [b], (0, 3): []})
    assert sink.tables[-1] == {(0, 0): [here], (0, 1): [here, a, b], (0, 2): [b]}
    assert live.missing([(0, 2), (0, 3), (1, 0)]) == [(0, 3), (1, 0)]
    live.set_colocated(ColocatedExperts({}))
    assert sink.tables[-1] == {(0, 1): [a, b], (0, 2): [b]} and len(sink.tables) == 3


def test_live_placement_tells_its_listeners_after_each_new_table() -> None:
    """What the router's EXPERTS_HEALTH follows: each listener sees the new table already there."""
    sink, a = Sink(), object()
    live = LivePlacement(sink, ColocatedExperts({(0, 0): None}))
    seen: list[list] = []
    live.listeners.append(lambda: seen.append(live.missing([(0, 0), (0, 1)])))
    live.set_remote({(0, 1): [a]})
    live.set_colocated(ColocatedExperts({}))
    live.set_remote({})
    assert seen == [[], [(0, 0)], [(0, 0), (0, 1)]]
