"""The hot-expert policy (choose_hot): the budget, hysteresis, dwell, pins, no stranding."""

from __future__ import annotations

import torch

from router_service.experts.tiering import TieringConfig, choose_hot

EB = 1000  # bytes of one expert in the policy tests


def skewed(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


LOAD = skewed(
    [
        [500, 300, 50, 50, 40, 30, 20, 10],  # layer 0: experts 0, 1 hot
        [20, 20, 20, 400, 20, 20, 250, 250],
    ]
)  # layer 1: experts 3, 6, 7 hot


EVERY = {(la, e) for la in range(2) for e in range(8)}


def test_policy_fills_the_budget_with_the_hottest_and_no_more() -> None:
    cfg = TieringConfig(budget_bytes=3 * EB + 999, expert_bytes=EB)
    assert choose_hot(LOAD, [0, 1], set(), cfg, EVERY) == {(0, 0), (1, 3), (0, 1)}
    roomy = TieringConfig(
        budget_bytes=100 * EB, expert_bytes=EB
    )  # only hot experts, however big the budget
    assert choose_hot(LOAD, [0, 1], set(), roomy, EVERY) == {(0, 0), (0, 1), (1, 3), (1, 6), (1, 7)}
    uniform = skewed([[100] * 8, [100] * 8])
    assert choose_hot(uniform, [0, 1], set(), roomy, EVERY) == set()
    cold_start = skewed([[5, 1, 0, 0, 0, 0, 0, 0], [0] * 8])  # too few tokens to call anything hot
    assert choose_hot(cold_start, [0, 1], set(), roomy, EVERY) == set()


def test_policy_hysteresis_dwell_pins_and_no_stranding() -> None:
    cfg = TieringConfig(budget_bytes=2 * EB, expert_bytes=EB, hysteresis=0.2)
    close = skewed([[300, 280, 260, 20, 20, 20, 20, 20], [100] * 8])
    # (0, 2) is an incumbent: 260 * 1.2 beats 280, so it is not swapped for a slightly hotter one
    assert choose_hot(close, [0, 1], {(0, 0), (0, 2)}, cfg, EVERY) == {(0, 0), (0, 2)}
    assert choose_hot(close, [0, 1], set(), cfg, EVERY) == {(0, 0), (0, 1)}
    # frozen pairs keep their tier: a just-demoted expert is not promoted back, a just-promoted one stays
    assert choose_hot(close, [0, 1], {(0, 2)}, cfg, EVERY, frozen={(0, 0), (0, 2)}) == {
        (0, 2),
        (0, 1),
    }
    pinned = TieringConfig(
        budget_bytes=2 * EB,
        expert_bytes=EB,
        pinned_hot=frozenset({(1, 0)}),
        pinned_remote=frozenset({(0, 0)}),
    )
    assert choose_hot(close, [0, 1], set(), pinned, EVERY) == {(1, 0), (0, 1)}
    # an expert with no remote replica stays colocated, whatever its load
    assert (1, 5) in choose_hot(close, [0, 1], {(1, 5)}, cfg, EVERY - {(1, 5)})
