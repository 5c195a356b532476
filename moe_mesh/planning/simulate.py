"""Predict one decode step of a deployment from profiled costs, for `moe-mesh plan --search`: the
ping-pong model of common/perfmodel.py extended to several expert services, replicas and shared
nodes. The derivation is docs/design/simulation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.perfmodel import Linear, split

Cost = Callable[[float], float]  # seconds against a size: Linear, or Piecewise through points


@dataclass(frozen=True)
class Side:
    """One measured side: wall seconds at `threads` threads, CPU seconds, against tokens."""

    wall: Cost
    cpu: Cost
    threads: int

    def time(self, x: float, threads: int) -> float:
        """Wall seconds on `threads` threads: never faster than measured, and on fewer threads at
        least the CPU work spread over them."""
        return max(self.wall(x), self.cpu(x) / threads)


@dataclass(frozen=True)
class Workload:
    """Request lengths a step is predicted for: with continuous batching each new request's prompt
    joins a decode step, so over a request's `output_len` decode steps its slot admits one
    prompt: on average batch·input_len/output_len prompt tokens ride along with every step (the
    ratio of mean lengths; lognormal lengths of one sigma have the ratio of their medians).

    First order: a prompt token is charged like a decode token (Ta, Te, the calls' bytes and the
    dense layers at tokens). Prefill attention, which grows with the prompt rather than the KV
    context Ta was profiled at, is not told apart. input_len 0: pure decode steps."""

    input_len: int = 0
    output_len: int = 1

    def prefill_tokens(self, batch: int) -> float:
        return batch * self.input_len / self.output_len


DECODE_ONLY = Workload()


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
    service_call: Linear | None = None  # Sc: a service's CPU per call beyond its FFN, vs bytes
    router_call: Linear | None = None  # Rc: the router's CPU per call, vs bytes
    service_expert: float = 0.0  # Sc's seconds per expert beyond the first in a call
    router_expert: float = 0.0  # Rc's
    expert_bytes: int = 0  # weights of one routed expert
    bandwidth: float = 0.0  # bytes/s a node reads (0: unknown, no bound)

    def service_cpu(self, nbytes: float, experts: float = 1.0) -> float:
        """Sc of a call of `nbytes` for `experts` experts: measured, else one Tc (each end of a
        transfer works for it)."""
        if self.service_call is None:
            return self.tc(nbytes)
        return self.service_call(nbytes) + self.service_expert * max(0.0, experts - 1)

    def router_cpu(self, nbytes: float, experts: float = 1.0) -> float:
        """Rc of a call: measured, else one Tc."""
        if self.router_call is None:
            return self.tc(nbytes)
        return self.router_call(nbytes) + self.router_expert * max(0.0, experts - 1)


def experts_per_call(expert_shares: Sequence[float], sequences: float, top_k: int) -> float:
    """Expected experts a call of `sequences` sequences carries rows for: a sequence routes to
    an expert holding share p of the layer's top_k slots with probability top_k·p."""
    return sum(1 - (1 - min(1.0, top_k * p)) ** sequences for p in expert_shares if p > 0)


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
    expert_shares: Sequence[Sequence[Sequence[float]]] | None = None,
    prefill_tokens: float = 0.0,
) -> Step:
    """One decode step of `batch` sequences in m micro-batches, with `prefill_tokens` prompt
    tokens of requests joining it (Workload.prefill_tokens; 0: pure decode).

    shares[l][g]: group g's share of MoE layer l's routed tokens; replicas[g]: its processes,
    which `nodes` place (one node has the router); expert_shares[l][g]: the shares of group g's
    experts in layer l, for the experts per call (without it: one per call)."""
    router_node = next(n for n in nodes if n.router)
    rt = router_node.threads
    group_threads = [
        min((n.threads for n in nodes if g in n.replicas), default=1) for g in range(len(replicas))
    ]
    parts = split(batch, m)
    # The engine balances micro-batches by tokens: each carries its share of the prompt tokens.
    # Ta, Te, the calls' bytes and the dense layers go by tokens; the LM head by sequences (only
    # each sequence's last token reaches it).
    tokens = [b * (1 + prefill_tokens / batch) for b in parts]
    pipeline = 0.0
    router_cpu = 0.0
    group_cpu = [0.0] * len(replicas)
    for li, layer in enumerate(shares):
        moe = _moe_layer(
            costs,
            layer,
            expert_shares[li] if expert_shares else None,
            replicas,
            nodes,
            tokens,
            rt,
            group_threads,
        )
        pipeline += moe.seconds
        router_cpu += moe.router_cpu
        for g, cpu in enumerate(moe.group_cpu):
            group_cpu[g] += cpu
    for b, t in zip(parts, tokens):
        pipeline += costs.head.time(b, rt)
        router_cpu += costs.head.cpu(b)
        if costs.dense is not None:
            pipeline += costs.dense_layers * costs.dense.time(t, rt)
            router_cpu += costs.dense_layers * costs.dense.cpu(t)
    step, bound = pipeline, "pipeline"
    for i, n in enumerate(nodes):
        # A group's work is spread over its replicas, wherever they are.
        cpu = router_cpu * n.router + sum(group_cpu[g] / replicas[g] for g in n.replicas)
        if cpu / n.cores > step:
            step, bound = cpu / n.cores, f"cpu of {n.kind} node {i}"
    return Step(step, pipeline, bound)


@dataclass(frozen=True)
class _MoeLayer:
    seconds: float  # the layer in the ping-pong pipeline
    router_cpu: float  # CPU seconds the router spends on it
    group_cpu: list[float]  # CPU seconds each expert group spends on it, over its replicas


def _moe_layer(
    costs: Costs,
    layer: Sequence[float],
    expert_shares: Sequence[Sequence[float]] | None,
    replicas: Sequence[int],
    nodes: Sequence[Node],
    tokens: list[float],
    rt: int,
    group_threads: list[int],
) -> _MoeLayer:
    """One MoE layer whose groups take `layer`'s shares of its tokens, in micro-batches of `tokens`."""
    ta = [costs.ta.time(b, rt) for b in tokens]
    te = [[s * costs.te.time(b, t) for b in tokens] for s, t in zip(layer, group_threads)]
    # Bytes of each group's call per micro-batch (None: no tokens, no call).
    x = [
        [s * b * costs.top_k * costs.bytes_per_token if s > 0 else None for b in tokens]
        for s in layer
    ]
    tc = [[costs.tc(v) if v is not None else 0.0 for v in row] for row in x]
    k = [
        [
            experts_per_call(expert_shares[g], b, costs.top_k) if expert_shares else 1.0
            for b in tokens
        ]
        for g in range(len(layer))
    ]
    sc = [
        [costs.service_cpu(v, n) if v is not None else 0.0 for v, n in zip(row, ks)]
        for row, ks in zip(x, k)
    ]
    rc = [
        [costs.router_cpu(v, n) if v is not None else 0.0 for v, n in zip(row, ks)]
        for row, ks in zip(x, k)
    ]
    shared = [
        _shared_round(
            costs,
            layer,
            replicas,
            nodes,
            b,
            [row[i] for row in x],
            [row[i] for row in k],
            [row[i] for row in sc],
            [row[i] for row in tc],
        )
        for i, b in enumerate(tokens)
    ]
    rounds = [
        ta[i] + max(max(row[i] for row in te) + 2 * max(row[i] for row in tc), shared[i])
        for i in range(len(tokens))
    ]
    # The router's event loop encodes, sends, receives and decodes every call itself.
    busy_a = sum(ta) + sum(map(sum, rc))
    busy_e = max((sum(t) + sum(c)) / r for t, c, r in zip(te, sc, replicas))
    return _MoeLayer(
        max(max(rounds), busy_a, busy_e),
        sum(costs.ta.cpu(b) for b in tokens) + sum(map(sum, rc)),
        [sum(s * costs.te.cpu(b) for b in tokens) + sum(sc[g]) for g, s in enumerate(layer)],
    )


def _shared_round(
    costs: Costs,
    layer: Sequence[float],
    replicas: Sequence[int],
    nodes: Sequence[Node],
    b: float,
    x: list[float | None],
    k: list[float],
    sc: list[float],
    tc: list[float],
) -> float:
    """A round of micro-batch tokens `b` on the busiest node: the calls of one round run at once,
    so the services on a node share its cores (a group's calls spread over its replicas), FFN
    and per-call work alike, and read their experts' weights through the node's one memory bus;
    then the part of a round trip that is not the service's work. x, k, sc, tc: per group."""
    busiest = 0.0
    for n in nodes:
        held = [(g, n.replicas.count(g) / replicas[g]) for g in set(n.replicas)]
        t = sum(w * (layer[g] * costs.te.cpu(b) + sc[g]) for g, w in held) / n.cores
        if costs.bandwidth:
            read = sum(w * k[g] for g, w in held if x[g] is not None)
            t = max(t, read * costs.expert_bytes / costs.bandwidth)
        busiest = max(busiest, t)
    wire = max(max(0.0, 2 * tc[g] - sc[g]) for g in range(len(layer)))
    return busiest + wire
