"""Predict one decode step of a deployment from profiled costs (the model of common/perfmodel.py,
extended to several expert services, replicas and shared nodes).

Per MoE layer, B sequences split into m micro-batches b_i (perfmodel.split). Expert group g takes
share s_g of the layer's routed tokens; its r replicas take turns (the router sends a micro-batch's
call to one replica), so

    round_i  = Ta(b_i) + max(max_g s_g·Te(b_i), max_n Σ_{g on n} s_g·Te_cpu(b_i) / cores_n)
               + 2·max_g Tc_g(b_i)                                      calls to all groups at once
    busy_a   = Σ_i (Ta(b_i) + Σ_g Tc_g(b_i))
    busy_g   = Σ_i (s_g·Te(b_i) + Tc_g(b_i)) / r_g
    layer    = max(max_i round_i, busy_a, max_g busy_g)

with Tc_g(b) = Tc(s_g·b·top_k·bytes per token); the second term of the round is the services of
one node computing their calls at once on its cores (more services than cores take turns: without
it, 7 services on a 2-core node were predicted to answer a round as if each had a core of its own). With Tc = 0, one group and one replica this is
perfmodel.layer_time. Unlike the paper's RDMA, a transfer here is work for both ends' CPUs
(serialisation, system calls, progress), so each end is busy one Tc per call: which is what makes
many small expert services cost the router. A step is the MoE layers plus, per micro-batch, the
dense (non-MoE) layers and the embedding + LM head.

Processes on one node share its cores: every process gets cores // processes threads (as `moe-mesh
up` hands them out); a side runs on t threads in max(measured wall, measured CPU / t) (never
faster than measured: nothing beyond the measurement is extrapolated); and the step is at least the
CPU seconds all processes of a node spend per step divided by its cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moe_mesh.common.perfmodel import Linear, split


@dataclass(frozen=True)
class Side:
    """One measured side: wall seconds at `threads` threads, CPU seconds, against sequences."""

    wall: Linear
    cpu: Linear
    threads: int

    def time(self, x: float, threads: int) -> float:
        """Wall seconds on `threads` threads: never faster than measured, and on fewer threads at
        least the CPU work spread over them."""
        return max(self.wall(x), self.cpu(x) / threads)


@dataclass(frozen=True)
class Costs:
    """What a profile says about one model on one kind of machine."""

    ta: Side  # router side of one MoE layer
    te: Side  # every expert of one MoE layer
    head: Side  # embedding + final norm + LM head
    dense: Side | None  # one non-MoE layer
    dense_layers: int
    tc: Linear  # one way, seconds against bytes, of the transport simulated
    bytes_per_token: int
    top_k: int


@dataclass(frozen=True)
class Node:
    """A machine of the deployment and the processes placed on it."""

    kind: str
    cores: int
    router: bool
    replicas: tuple[int, ...]  # group index of each expert-service process on it

    @property
    def threads(self) -> int:
        return max(1, self.cores // (int(self.router) + len(self.replicas)))


@dataclass(frozen=True)
class Step:
    seconds: float
    pipeline_s: float  # the ping-pong model alone
    bound: str  # "pipeline" or "cpu of <kind> node <i>"


def simulate(
    costs: Costs,
    shares: Sequence[Sequence[float]],
    replicas: Sequence[int],
    nodes: Sequence[Node],
    batch: int,
    m: int,
) -> Step:
    """One decode step of `batch` sequences in m micro-batches.

    shares[l][g]: group g's share of MoE layer l's routed tokens; replicas[g]: its processes,
    which `nodes` place (one node has the router)."""
    router_node = next(n for n in nodes if n.router)
    rt = router_node.threads
    group_threads = [
        min((n.threads for n in nodes if g in n.replicas), default=1) for g in range(len(replicas))
    ]
    parts = split(batch, m)
    pipeline = 0.0
    router_cpu = 0.0
    group_cpu = [0.0] * len(replicas)
    for layer in shares:
        ta = [costs.ta.time(b, rt) for b in parts]
        te = [[s * costs.te.time(b, t) for b in parts] for s, t in zip(layer, group_threads)]
        tc = [
            [costs.tc(s * b * costs.top_k * costs.bytes_per_token) if s > 0 else 0.0 for b in parts]
            for s in layer
        ]
        # The calls of one round run at once: the services on a node share its cores, so their
        # part of the round takes at least their CPU seconds over its cores (a group's calls
        # spread over its replicas).
        shared = [
            max(
                sum(
                    n.replicas.count(g) / replicas[g] * layer[g] * costs.te.cpu(b)
                    for g in set(n.replicas)
                )
                / n.cores
                for n in nodes
            )
            for b in parts
        ]
        rounds = [
            ta[i] + max(max(row[i] for row in te), shared[i]) + 2 * max(row[i] for row in tc)
            for i in range(len(parts))
        ]
        # Each end of a transfer is busy for it (serialisation, system calls): one Tc per call.
        busy_a = sum(ta) + sum(map(sum, tc))
        busy_e = max((sum(t) + sum(c)) / r for t, c, r in zip(te, tc, replicas))
        pipeline += max(max(rounds), busy_a, busy_e)
        router_cpu += sum(costs.ta.cpu(b) for b in parts) + sum(map(sum, tc))
        for g, s in enumerate(layer):
            group_cpu[g] += sum(s * costs.te.cpu(b) for b in parts) + sum(tc[g])
    for b in parts:
        pipeline += costs.head.time(b, rt)
        router_cpu += costs.head.cpu(b)
        if costs.dense is not None:
            pipeline += costs.dense_layers * costs.dense.time(b, rt)
            router_cpu += costs.dense_layers * costs.dense.cpu(b)
    step, bound = pipeline, "pipeline"
    for i, n in enumerate(nodes):
        # A group's work is spread over its replicas, wherever they are.
        cpu = router_cpu * n.router + sum(group_cpu[g] / replicas[g] for g in n.replicas)
        if cpu / n.cores > step:
            step, bound = cpu / n.cores, f"cpu of {n.kind} node {i}"
    return Step(step, pipeline, bound)
