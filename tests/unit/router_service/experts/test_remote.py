"""Splitting a call larger than one message into pieces, and joining the pieces' outputs."""

from __future__ import annotations

import pytest
import torch

from router_service.experts.remote import ExpertOutputs, joined_outputs, split_rows


def test_pieces_hold_at_most_the_rows_and_join_back_in_order() -> None:
    groups = [
        (3, torch.arange(5.0)[:, None]),
        (0, torch.zeros(0, 1)),
        (7, torch.arange(9.0)[:, None]),
    ]
    pieces = split_rows(groups, 4)
    assert [sum(rows.shape[0] for _, (_, rows) in p) for p in pieces] == [4, 4, 4, 2]
    assert [[(i, e) for i, (e, _) in p] for p in pieces] == [
        [(0, 3)],
        [(0, 3), (1, 0), (2, 7)],
        [(2, 7)],
        [(2, 7)],
    ]
    # Each piece's call answers its rows (here: themselves); the call's answer is one per group.
    outputs = [
        ExpertOutputs([rows for _, (_, rows) in p], "ucx", 0.1 * k) for k, p in enumerate(pieces)
    ]
    joined = joined_outputs(len(groups), pieces, outputs)
    assert all(torch.equal(j, rows) for j, (_, rows) in zip(joined, groups))
    assert joined.service_s == pytest.approx(0.3) and joined.transport == "ucx"  # side by side
    outputs[1].transport = "grpc"  # one piece fell back
    assert joined_outputs(len(groups), pieces, outputs).transport == "grpc"


def test_a_call_within_the_limit_is_one_piece() -> None:
    groups = [(1, torch.ones(3, 2)), (2, torch.ones(1, 2))]
    assert [[e for _, (e, _) in p] for p in split_rows(groups, 4)] == [[1, 2]]
    assert len(split_rows(groups, 0)) == 4  # at least a row a piece
