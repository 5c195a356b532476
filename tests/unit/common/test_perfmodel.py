import pytest

from common.perfmodel import (
    LayerCosts,
    Linear,
    Piecewise,
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


def test_piecewise_passes_through_the_points_and_carries_the_end_segments_on():
    # A cost that bends upwards: a straight line over 1..16 undershoots at 16, this does not.
    cost = Piecewise.through([1, 4, 8, 16], [2.0, 3.0, 4.0, 10.0])
    assert [cost(x) for x in (1, 4, 8, 16)] == [2.0, 3.0, 4.0, 10.0]
    assert Linear.fit([1, 4, 8, 16], [2.0, 3.0, 4.0, 10.0])(16) < 10.0
    assert cost(6) == pytest.approx(3.5)  # between neighbours
    assert cost(32) == pytest.approx(22.0)  # the last segment's 0.75 per unit beyond the end
    assert cost(0) == pytest.approx(2.0 - 1 / 3)  # the first segment's slope below the start
    assert Piecewise.through([10, 20], [0.5, 5.0])(0) == 0.0  # never negative


def test_piecewise_never_shrinks_with_work_and_averages_repeats():
    cost = Piecewise.through([4, 1, 2, 2], [3.0, 2.0, 1.0, 2.0])  # order does not matter
    assert cost.xs == (1.0, 2.0, 4.0)
    assert cost.ys == (2.0, 2.0, 3.0)  # x = 2: mean 1.5, raised to the 2.0 before it
    assert Piecewise.through([4, 4], [2.0, 4.0]) == Linear(0.0, 3.0)  # one x: Linear.fit's
    with pytest.raises(ValueError):
        Piecewise.through([], [])
    with pytest.raises(ValueError):
        Piecewise((1.0, 1.0), (1.0, 2.0))


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
