import pytest

from moe_mesh.common.perfmodel import (
    LayerCosts,
    Linear,
    best_micro_batches,
    layer_time,
    paper_minimum,
    split,
)


def test_fit_recovers_a_line_and_keeps_costs_non_negative():
    fit = Linear.fit([1, 2, 4, 8], [3.0, 5.0, 9.0, 17.0])
    assert fit.slope == pytest.approx(2.0) and fit.intercept == pytest.approx(1.0)
    assert Linear.fit([4, 4], [2.0, 4.0]) == Linear(0.0, 3.0)  # one x: all fixed cost
    assert Linear.fit([1, 2], [5.0, 3.0]).slope == 0.0  # noise that slopes down
    through_origin = Linear.fit([1, 2, 3], [0.0, 3.0, 6.0])
    assert through_origin.intercept == 0.0 and through_origin.slope > 0
    with pytest.raises(ValueError):
        Linear.fit([], [])


def test_split_is_even_and_never_empty():
    assert split(10, 3) == [4, 3, 3]
    assert split(2, 4) == [1, 1]
    assert sum(split(33, 4)) == 33


def test_layer_time_is_the_round_or_the_busier_side():
    transfer_bound = lambda b: LayerCosts(ta=1.0 * b, te=1.0 * b, tc=10.0)  # noqa: E731
    assert layer_time(transfer_bound, 4, 1) == pytest.approx(4 + 4 + 20)
    # Four micro-batches of one: a round is 22, each side is busy 4.
    assert layer_time(transfer_bound, 4, 4) == pytest.approx(22)
    assert best_micro_batches(transfer_bound, 4) == 4
    # A large fixed cost per call (weights read again per micro-batch) makes splitting lose.
    fixed_bound = lambda b: LayerCosts(ta=0.1 * b, te=10.0 + 0.1 * b, tc=0.5)  # noqa: E731
    assert best_micro_batches(fixed_bound, 32) == 1
    assert best_micro_batches(transfer_bound, 1) == 1


def test_paper_minimum():
    assert paper_minimum(LayerCosts(ta=2.0, te=2.0, tc=1.0)) == 3
    assert paper_minimum(LayerCosts(ta=0.0, te=0.0, tc=1.0)) == 1
