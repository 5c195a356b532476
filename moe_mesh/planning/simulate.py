"""Predict one decode step of a deployment from profiled costs (the model of common/perfmodel.py,
extended to several expert services, replicas and shared nodes).

Per MoE layer, B sequences split into m micro-batches b_i (perfmodel.split). Expert group g takes
share s_g of the layer's routed tokens; its r replicas take turns (the router sends a micro-batch's
call to one replica). A call of micro-batch i to group g carries x_gi = s_g·b_i·top_k·bytes per
token each way for k_gi experts (expected: Σ_e 1 − (1 − top_k·p_e)^b_i over g's experts, p_e
an expert's share of the layer's slots) and costs, besides its FFN, CPU at both ends measured per
call by `moe-mesh profile`: Sc(x, k) in the service (receive, decode, batcher, one batch and
one hand-off to the compute thread, encode, send) and Rc(x, k) in the router (encode,
send, receive, decode), each linear in x plus a cost per expert beyond the first. Then

    round_i  = Ta(b_i) + max( max_g s_g·Te(b_i) + 2·max_g Tc(x_gi),
                              max_n max(E_ni / cores_n, W_ni / bandwidth_n)
                                + max_g (2·Tc(x_gi) − Sc(x_gi))⁺ )
    E_ni     = Σ_{g on n} (replicas of g on n / r_g)·(s_g·Te_cpu(b_i) + Sc(x_gi))
    W_ni     = Σ_{g on n} (replicas of g on n / r_g)·k_gi·expert_bytes
    busy_a   = Σ_i (Ta(b_i) + Σ_g Rc(x_gi))
    busy_g   = Σ_i (s_g·Te(b_i) + Sc(x_gi)) / r_g
    layer    = max(max_i round_i, busy_a, max_g busy_g)

The calls of a round are in flight at once. The first term is the slowest call alone: its FFN and
two one-way transfers Tc (half the measured round trip beyond the FFN, so it holds both ends'
per-call work for one idle call). The second is the services of a node computing their calls at
once on its cores (more services than cores take turns: 7 services on a 2-core node do not answer
as if each had a core of its own), FFN and per-call CPU alike, and reading the weights of the
k_gi experts each call computes through the node's one memory bus (W_ni bytes at the profile's
measured read bandwidth: on the `small` preset a decode round reads every expert of the layer,
and four services computing at once took as long as that, not a quarter of the FFN time each);
then the part of a round trip that is not the service's work (the wire, the router's side). The router's event loop encodes, sends,
receives and decodes every call itself: Rc per call in busy_a. With Tc = Sc = Rc = 0, one group
and one replica this is perfmodel.layer_time. Unlike the paper's RDMA, a transfer here is work for both ends'
CPUs, so many small expert services cost the router (Rc per call) and their node (Sc per call). A
profile without per-call CPU (format 1, or a service whose pid it did not know) charges each end
one Tc per call instead. A step is the MoE layers plus, per micro-batch, the dense (non-MoE)
layers and the embedding + LM head.

With a workload (Workload), every step also carries P = B·input_len/output_len prompt tokens,
spread over the micro-batches as the engine balances them by tokens: b_i above become the
micro-batch's tokens b_i·(1 + P/B) wherever a cost goes by tokens (Ta, Te, the calls' bytes and
experts, the dense layers); the LM head stays at b_i sequences. Tokens/s = B / step.

Costs are seconds through the profile's measured points (common/perfmodel.Piecewise), not one
straight line through them all, which undershoots costs that bend between the sizes measured.

Processes on one node share its cores: every process gets cores // processes threads (as `moe-mesh
up` hands them out); a side runs on t threads in max(measured wall, measured CPU / t) (never
faster than measured: nothing beyond the measurement is extrapolated); and the step is at least the
CPU seconds all processes of a node spend per step (Ta, Te, head, dense and every call's Sc and Rc)
divided by its cores.
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
                experts_per_call(expert_shares[li][g], b, costs.top_k) if expert_shares else 1.0
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
        # The calls of one round run at once: the services on a node share its cores (a group's
        # calls spread over its replicas), FFN and per-call work alike, and read their experts'
        # weights through the node's one memory bus.
        shared = []
        for i, b in enumerate(tokens):
            busiest = 0.0
            for n in nodes:
                held = [(g, n.replicas.count(g) / replicas[g]) for g in set(n.replicas)]
                t = sum(w * (layer[g] * costs.te.cpu(b) + sc[g][i]) for g, w in held) / n.cores
                if costs.bandwidth:
                    read = sum(w * k[g][i] for g, w in held if x[g][i] is not None)
                    t = max(t, read * costs.expert_bytes / costs.bandwidth)
                busiest = max(busiest, t)
            wire = max(max(0.0, 2 * tc[g][i] - sc[g][i]) for g in range(len(layer)))
            shared.append(busiest + wire)
        rounds = [
            ta[i] + max(max(row[i] for row in te) + 2 * max(row[i] for row in tc), shared[i])
            for i in range(len(parts))
        ]
        # The router's event loop encodes, sends, receives and decodes every call itself.
        busy_a = sum(ta) + sum(map(sum, rc))
        busy_e = max((sum(t) + sum(c)) / r for t, c, r in zip(te, sc, replicas))
        pipeline += max(max(rounds), busy_a, busy_e)
        router_cpu += sum(costs.ta.cpu(b) for b in tokens) + sum(map(sum, rc))
        for g, s in enumerate(layer):
            group_cpu[g] += sum(s * costs.te.cpu(b) for b in tokens) + sum(sc[g])
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
