"""The step predictor of `moe-mesh plan --search`: the ping-pong layer, replicas, shared cores."""

from __future__ import annotations

import pytest

from moe_mesh.common.perfmodel import LayerCosts, Linear, layer_time
from moe_mesh.planning.simulate import Costs, Node, Side, simulate

MS = 1e-3


STANDARD = Linear(0.1 * MS, 1 * MS)
NONE = Linear(0, 0)


def costs(ta=STANDARD, te=STANDARD, tc=NONE, cpu=None):
    """Router measured on 2 threads, experts on 1; CPU seconds = wall unless given."""
    return Costs(
        ta=Side(ta, cpu or ta, 2),
        te=Side(te, te, 1),
        head=Side(Linear(0, 0), Linear(0, 0), 2),
        dense=None,
        dense_layers=0,
        tc=tc,
        bytes_per_token=1000,
        top_k=2,
    )


def big_node(groups: int = 1) -> tuple[Node, ...]:
    return (Node("big", 64, True, ()), Node("big", 64, False, tuple(range(groups))))


@pytest.mark.parametrize("batch, m", [(8, 1), (8, 2), (32, 4), (3, 4)])
def test_one_group_without_transfers_is_perfmodels_layer(batch: int, m: int) -> None:
    c = costs()
    step = simulate(c, [[1.0]], [1], big_node(), batch, m)

    def per_micro_batch(b: int) -> LayerCosts:
        return LayerCosts(c.ta.wall(b), c.te.wall(b), 0.0)

    assert step.seconds == pytest.approx(layer_time(per_micro_batch, batch, m))
    assert step.bound == "pipeline"


def test_layers_add_and_transfers_occupy_both_ends() -> None:
    c = costs(tc=Linear(0, 0.5 * MS))
    one = simulate(c, [[1.0]], [1], big_node(), 8, 1).seconds
    # One micro-batch: Ta 1.8 + Te 1.8 + 2 x 0.5 ms per layer.
    assert one == pytest.approx(4.6 * MS)
    assert simulate(c, [[1.0]] * 3, [1], big_node(), 8, 1).seconds == pytest.approx(3 * one)
    # Four groups called at once: the round waits on the slowest (1/4 of Te), but the router pays
    # one Tc per call: busy 1.8 + 4 x 0.5 = 3.8 ms > round 1.8 + 0.45 + 1 + ...
    four = simulate(c, [[0.25] * 4], [1] * 4, big_node(4), 8, 1).seconds
    assert four == pytest.approx(max(1.8 + 0.25 * 1.8 + 1.0, 1.8 + 4 * 0.5) * MS)


def test_replicas_split_a_groups_busy_time_not_its_round() -> None:
    c = costs(ta=Linear(0, 0.1 * MS), te=Linear(1 * MS, 0))  # experts dominate
    nodes = big_node()
    single = simulate(c, [[1.0]], [1], nodes, 8, 4).seconds  # busy 8 ms
    assert single == pytest.approx(8 * MS)
    double = simulate(c, [[1.0]], [2], nodes, 8, 4).seconds
    assert double == pytest.approx(4 * MS)  # two replicas take turns
    one_round = simulate(c, [[1.0]], [2], nodes, 8, 1).seconds
    assert one_round == pytest.approx(8.1 * MS)  # one micro-batch cannot use the second


def test_processes_sharing_a_node_are_bound_by_its_cores() -> None:
    c = costs(ta=Linear(0, 2 * MS), te=Linear(0, 2 * MS))
    apart = simulate(c, [[1.0]], [1], big_node(), 4, 2).seconds
    assert apart == pytest.approx(4 * MS)  # each side busy 2 x 2 ms
    # 2 cores, router + service: 1 thread each, and 8 ms of CPU per step fill both cores exactly.
    shared = simulate(c, [[1.0]], [1], (Node("small", 2, True, (0,)),), 4, 2)
    assert shared.seconds == pytest.approx(4 * MS)
    one_core = simulate(c, [[1.0]], [1], (Node("tiny", 1, True, (0,)),), 4, 2)
    assert one_core.seconds == pytest.approx(8 * MS) and one_core.bound == "cpu of tiny node 0"


def test_services_called_at_once_share_their_nodes_cores_within_a_round() -> None:
    c = costs(ta=Linear(0, 1 * MS), te=Linear(0, 4 * MS))
    # Four services with a quarter of the tokens each: 1 ms apiece on cores of their own ...
    apart = simulate(c, [[0.25] * 4], [1] * 4, big_node(4), 8, 1).seconds
    assert apart == pytest.approx((1 + 1) * MS)
    # ... but on 2 cores their 4 ms of CPU take 2 ms whatever their threads: one micro-batch
    # leaves the router idle meanwhile, which the node's CPU bound (5 ms / 2 cores) misses.
    shared = simulate(c, [[0.25] * 4], [1] * 4, (Node("small", 2, True, (0, 1, 2, 3)),), 8, 1)
    assert shared.seconds == pytest.approx((1 + 2) * MS) and shared.bound == "pipeline"
    # Replicas on another node take their share of the calls off this node.
    two = (Node("small", 2, True, (0, 1, 2, 3)), Node("small", 2, False, (0, 1, 2, 3)))
    assert simulate(c, [[0.25] * 4], [2] * 4, two, 8, 1).seconds == pytest.approx(2 * MS)


def test_fewer_threads_than_measured_run_the_cpu_work_on_them() -> None:
    side = Side(Linear(0, 1 * MS), Linear(0, 1.6 * MS), threads=2)
    assert side.time(1, 2) == pytest.approx(1 * MS)  # as measured
    assert side.time(1, 1) == pytest.approx(1.6 * MS)  # the work on one thread
    assert side.time(1, 8) == pytest.approx(1 * MS)  # never faster than measured
