"""The step predictor of `moe-mesh plan --search`: the ping-pong layer, replicas, shared cores."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.perfmodel import LayerCosts, Linear, layer_time
from moe_mesh.planning.simulate import (
    Costs,
    Node,
    Side,
    Workload,
    experts_per_call,
    simulate,
)

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


def per_call(ta: float, te: float, tc: float, service: float | None, router: float | None) -> Costs:
    """Fixed costs in ms: Ta, Te of all experts, Tc one way, and each end's CPU per call."""

    def fixed(ms: float | None) -> Linear | None:
        return None if ms is None else Linear(0, ms * MS)

    return Costs(
        ta=Side(fixed(ta), fixed(ta), 2),
        te=Side(fixed(te), fixed(te), 1),
        head=Side(NONE, NONE, 2),
        dense=None,
        dense_layers=0,
        tc=fixed(tc),
        bytes_per_token=1000,
        top_k=2,
        service_call=fixed(service),
        router_call=fixed(router),
    )


def test_a_calls_service_cpu_counts_in_the_round_and_the_nodes_cpu() -> None:
    # Four services with a quarter of the tokens each (1 ms of FFN) and 1 ms of per-call CPU,
    # the router 0.25 ms per call, Tc 0.5 ms one way.
    c = per_call(ta=2, te=4, tc=0.5, service=1, router=0.25)
    shares = [[0.25] * 4]
    # Cores to spare: each call alone, 2 + 1 + 2 x 0.5 ms; the router busy 2 + 4 x 0.25.
    apart = simulate(c, shares, [1] * 4, big_node(4), 8, 1)
    assert apart.seconds == pytest.approx(4 * MS) and apart.bound == "pipeline"
    # Router and four services on 2 cores: the services' 4 x (1 + 1) ms of CPU take 4 ms, then
    # what of the round trip is not the service's work (2 x 0.5 - 1 = 0).
    small = (Node("small", 2, True, (0, 1, 2, 3)),)
    shared = simulate(c, shares, [1] * 4, small, 8, 1)
    assert shared.seconds == pytest.approx((2 + 4) * MS) and shared.bound == "pipeline"
    # Two micro-batches: per step the router spends 2 x (2 + 1) ms, the services 2 x 8 ms, on 2
    # cores: 11 ms, more than the pipeline's 6 ms (rounds of 6 ms, the router busy 6 ms).
    two = simulate(c, shares, [1] * 4, small, 8, 2)
    assert two.seconds == pytest.approx(11 * MS) and two.bound == "cpu of small node 0"
    assert two.pipeline_s == pytest.approx(6 * MS)


def test_the_routers_cpu_per_call_makes_many_services_cost_it() -> None:
    # Eight services of 0.1 ms FFN each: the router's 8 x 0.5 ms per call outweigh its 1 ms Ta.
    c = per_call(ta=1, te=0.8, tc=0.2, service=0, router=0.5)
    step = simulate(c, [[1 / 8] * 8], [1] * 8, big_node(8), 8, 1)
    assert step.seconds == pytest.approx((1 + 8 * 0.5) * MS)
    one = simulate(c, [[1.0]], [1], big_node(1), 8, 1)
    assert one.seconds == pytest.approx(max(1 + 0.8 + 0.4, 1 + 0.5) * MS)


def test_without_per_call_cpu_each_end_pays_one_tc() -> None:
    measured = per_call(ta=2, te=4, tc=0.5, service=0.5, router=0.5)
    old = per_call(ta=2, te=4, tc=0.5, service=None, router=None)
    small = (Node("small", 2, True, (0, 1, 2, 3)),)
    for m in (1, 2):
        a = simulate(measured, [[0.25] * 4], [1] * 4, small, 8, m)
        assert simulate(old, [[0.25] * 4], [1] * 4, small, 8, m) == a
    assert old.service_cpu(1e6) == old.router_cpu(0) == 0.5 * MS


def test_each_expert_a_call_carries_adds_its_batch() -> None:
    # Two experts with a quarter of the slots each (top-2): a sequence picks each with
    # probability 1/2, so one sequence's call carries 1 expert on average, many sequences' 2.
    assert experts_per_call([0.25, 0.25], 1, 2) == pytest.approx(1.0)
    assert experts_per_call([0.25, 0.25], 3, 2) == pytest.approx(2 * (1 - 0.5**3))
    assert experts_per_call([0.5, 0.0], 1, 2) == pytest.approx(1.0)
    c = replace(per_call(ta=2, te=4, tc=0.5, service=1, router=0.25), service_expert=0.5 * MS)
    # One group of two experts, B = 3 in one micro-batch: 1.75 experts per call, so the service
    # spends 1 + 0.75 x 0.5 ms on the call beyond its 4 ms FFN; on a 1-core node with the router
    # (2 + 0.25 ms) the step is 7.625 ms of CPU.
    one_core = (Node("one", 1, True, (0,)),)
    step = simulate(c, [[1.0]], [1], one_core, 3, 1, [[[0.25, 0.25]]])
    assert step.seconds == pytest.approx((2 + 0.25 + 4 + 1 + 0.375) * MS)
    assert step.bound == "cpu of one node 0"
    assert simulate(c, [[1.0]], [1], one_core, 3, 1).seconds == pytest.approx(7.25 * MS)


def test_prompt_tokens_ride_along_with_decode_steps() -> None:
    """B = 8 in a closed loop of 64-token prompts and 128-token outputs: 8 x 64 / 128 = 4 prompt
    tokens join every step, split over the micro-batches like the engine's token balance."""
    workload = Workload(input_len=64, output_len=128)
    assert workload.prefill_tokens(8) == 4.0
    assert Workload().prefill_tokens(8) == 0.0  # pure decode
    head = Linear(0.5 * MS, 0)
    c = replace(costs(tc=Linear(1e-6, 0)), head=Side(head, head, 2))
    mixed = simulate(c, [[1.0]], [1], big_node(), 8, 2, prefill_tokens=4.0)
    # Ta and Te, and the calls' bytes, go by tokens: 12 of them in two micro-batches of 6 ...
    as_tokens = simulate(c, [[1.0]], [1], big_node(), 12, 2)
    # ... but only each sequence's last token reaches the LM head: 8, not 12.
    head_gap = 2 * (head(6) - head(4))
    assert mixed.seconds == pytest.approx(as_tokens.seconds - head_gap)
    assert mixed.seconds > simulate(c, [[1.0]], [1], big_node(), 8, 2).seconds


def test_services_on_one_node_read_their_experts_through_its_one_memory_bus() -> None:
    # Four groups of two experts, one node; 32 sequences hit every expert of the layer.
    shares, experts = [[0.25] * 4], [[[0.0625, 0.0625]] * 4]
    nodes = (Node("host", 2, True, (0, 1, 2, 3)),)
    c = costs()
    unbounded = simulate(c, shares, [1] * 4, nodes, 32, 1, experts).seconds
    # 8 experts x 40 MB at 20 GB/s: 16 ms of reading, longer than the services' CPU.
    bounded = simulate(
        replace(c, expert_bytes=40_000_000, bandwidth=20e9), shares, [1] * 4, nodes, 32, 1, experts
    ).seconds
    k = experts_per_call([0.0625, 0.0625], 32, 2)
    assert bounded == pytest.approx(c.ta.wall(32) + 4 * k * 40_000_000 / 20e9)
    assert bounded > unbounded
    # Machines whose bus keeps up: the CPU bound stands.
    fast = replace(c, expert_bytes=40_000_000, bandwidth=1e15)
    assert simulate(fast, shares, [1] * 4, nodes, 32, 1, experts).seconds == pytest.approx(
        unbounded
    )
