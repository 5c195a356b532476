"""`moe-mesh plan --search`: MegaScale-Infer's deployment-plan search over what a profile measured.

Enumerates expert-service groups (S groups balanced by load with the EPLB packing), replicas per
group, micro-batches m, batch size B (powers of two up to the router's max_num_seqs), the transport,
and where processes run (the router on a node of one kind, expert services with it or spread over
nodes of one kind); predicts each with moe_mesh/planning/simulate.py and ranks those meeting the
TPOT SLO by decode tokens/s per cost per hour.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.placement import Pair, format_experts
from moe_mesh.planning.deploy.plan import Plan, PlanError
from moe_mesh.planning.eplb import GroupProposal, PlanOptions, propose
from moe_mesh.planning.inventory import Inventory, NodeKind
from moe_mesh.planning.profile_format import Measured, ProfileFile
from moe_mesh.planning.record import Record
from moe_mesh.planning.resources import MHZ_PER_CORE, MIN_MHZ, group_device, memory_mb
from moe_mesh.planning.simulate import DECODE_ONLY, Costs, Node, Side, Step, Workload, simulate

MAX_M = 4


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int = 32
    max_services: int = 8
    max_replicas: int = 2
    tpot_slo_s: float | None = None


@dataclass(frozen=True)
class Candidate:
    groups: tuple[GroupProposal, ...]
    replicas: int
    m: int
    batch: int
    transport: str
    nodes: tuple[Node, ...]
    step: Step
    cost_per_hour: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step.seconds

    @property
    def per_cost(self) -> float:
        return self.tokens_per_s / self.cost_per_hour if self.cost_per_hour else float("inf")


def _side(m: Measured) -> Side:
    return Side(m.wall_cost(), m.cpu_cost(), m.threads)


def costs(profile: ProfileFile, transport: str) -> Costs:
    measured = profile.transports[transport]
    return Costs(
        ta=_side(profile.ta),
        te=_side(profile.te),
        head=_side(profile.head),
        dense=_side(profile.dense) if profile.dense else None,
        dense_layers=profile.num_layers - len(profile.moe_layers),
        tc=measured.fit.linear(),
        bytes_per_token=profile.bytes_per_token,
        top_k=profile.top_k,
        expert_bytes=profile.expert_bytes,
        bandwidth=profile.memory_bandwidth or 0.0,
        service_call=measured.service_call_cpu.linear() if measured.service_call_cpu else None,
        router_call=measured.router_call_cpu.linear() if measured.router_call_cpu else None,
        service_expert=measured.service_expert_cpu or 0.0,
        router_expert=measured.router_expert_cpu or 0.0,
    )


def all_transports(profile: ProfileFile) -> dict[str, Costs]:
    """Costs of each transport the profile measured."""
    return {t: costs(profile, t) for t, v in profile.transports.items() if v.fit is not None}


def planning_load(profile: ProfileFile, load: dict[Pair, float]) -> dict[Pair, float]:
    """The record's load per pair; a MoE layer the record saw no token of takes the profile's
    shares (random input through the real gate) instead, so it is still balanced."""
    out = dict(load)
    for layer in profile.moe_layers:
        row = [load.get((layer, e), 0.0) for e in range(profile.num_experts)]
        if sum(row) <= 0:
            fallback = profile.expert_load_shares.get(str(layer), [1.0] * profile.num_experts)
            out.update({(layer, e): float(x) for e, x in enumerate(fallback)})
    return out


def expert_shares(
    moe_layers: Sequence[int], groups: Sequence[Sequence[Pair]], load: dict[Pair, float]
) -> list[list[list[float]]]:
    """shares[l][g]: the share of MoE layer l's routed tokens of each expert of group g (its pairs)."""
    out = []
    for layer in moe_layers:
        total = sum(x for (la, _), x in load.items() if la == layer) or 1.0
        out.append([[load[p] / total for p in g if p[0] == layer] for g in groups])
    return out


def layer_shares(per_expert: list[list[list[float]]]) -> list[list[float]]:
    """shares[l][g]: group g's share of MoE layer l's routed tokens (from expert_shares)."""
    return [[sum(g) for g in layer] for layer in per_expert]


Placed = list[tuple[NodeKind, bool, list[int]]]  # per node: kind, has the router, its processes


def layouts(
    inventory: Inventory, processes: int, router_bytes: int, bytes_per_process: list[int]
) -> Iterator[tuple[Placed, float]]:
    """(placement, cost per hour) per layout whose weights fit in memory: the router on a node of
    one kind; the expert-service processes on that node, or round-robin over n nodes of one kind."""
    procs = list(range(processes))
    for rk in inventory.kinds:
        options: list[tuple[NodeKind, int]] = [(rk, 0)]
        for ek in inventory.kinds:
            spare = ek.available - (ek is rk)
            options += [(ek, n) for n in range(1, min(spare, processes) + 1)]
        for ek, n in options:
            if n == 0:
                placed = [(rk, True, procs)]
            else:
                placed = [(rk, True, [])] + [(ek, False, procs[i::n]) for i in range(n)]
            fits = all(
                kind.memory_bytes >= router_bytes * router + sum(bytes_per_process[p] for p in mine)
                for kind, router, mine in placed
            )
            if fits:
                yield placed, sum(k.cost_per_hour for k, _, _ in placed)


def search(
    profile: ProfileFile,
    load: dict[Pair, float],
    inventory: Inventory,
    limits: Limits,
    workload: Workload = DECODE_ONLY,
    scale: float = 1.0,
) -> list[Candidate]:
    """Every feasible candidate meeting the SLO, best first (tokens/s per cost, then tokens/s,
    then fewer processes and micro-batches: the simpler deployment on a tie). Steps carry the
    workload's prompt tokens (Workload; the default: pure decode) and are multiplied by `scale`
    (calibrate.py) before the SLO is checked."""
    load = planning_load(profile, load)
    all_costs = all_transports(profile)
    batches = [b for b in (2**i for i in range(13)) if b <= limits.max_num_seqs]
    out = []
    for services in range(1, min(limits.max_services, profile.num_experts) + 1):
        proposal = propose(load, profile.expert_bytes, PlanOptions(0, services, 0))
        groups = proposal.groups
        per_expert = expert_shares(profile.moe_layers, [g.pairs for g in groups], load)
        shares = layer_shares(per_expert)
        for r in range(1, limits.max_replicas + 1):
            # Process p serves group p % len(groups): replicas of one group spread over nodes.
            owner = [p % len(groups) for p in range(len(groups) * r)]
            sizes = [len(groups[g].pairs) * profile.expert_bytes for g in owner]
            for placed, cost in layouts(inventory, len(owner), profile.dense_bytes, sizes):
                nodes = tuple(
                    Node(k.name, k.cores, router, tuple(owner[p] for p in mine))
                    for k, router, mine in placed
                )
                for transport, c in all_costs.items():
                    for b in batches:
                        for m in range(1, min(MAX_M, b) + 1):
                            step = simulate(
                                c,
                                shares,
                                [r] * len(groups),
                                nodes,
                                b,
                                m,
                                per_expert,
                                workload.prefill_tokens(b),
                            )
                            step = Step(step.seconds * scale, step.pipeline_s * scale, step.bound)
                            if limits.tpot_slo_s is None or step.seconds <= limits.tpot_slo_s:
                                out.append(Candidate(groups, r, m, b, transport, nodes, step, cost))
    out.sort(
        key=lambda c: (
            -c.per_cost,
            -c.tokens_per_s,
            len(c.groups) * c.replicas,
            c.m,
            c.transport,
        )
    )
    return out


def table(candidates: list[Candidate]) -> str:
    head = (
        f"{'#':>2}  {'groups':>6} {'repl':>4} {'m':>2} {'B':>4} {'transport':<9} {'nodes':<24} "
        f"{'cost/h':>7} {'TPOT ms':>8} {'tokens/s':>9} {'tok/s per cost/h':>16}  bound"
    )
    lines = [head]
    for i, c in enumerate(candidates, 1):
        nodes = " + ".join(_node_text(n) for n in c.nodes)
        per_cost = "inf" if c.per_cost == float("inf") else f"{c.per_cost:.0f}"
        lines.append(
            f"{i:>2}  {len(c.groups):>6} {c.replicas:>4} {c.m:>2} {c.batch:>4} {c.transport:<9} "
            f"{nodes:<24} {c.cost_per_hour:>7.2f} {c.step.seconds * 1e3:>8.2f} "
            f"{c.tokens_per_s:>9.1f} {per_cost:>16}  {c.step.bound}"
        )
    return "\n".join(lines)


def _node_text(n: Node) -> str:
    what = (["R"] if n.router else []) + ([f"{len(n.replicas)}E"] if n.replicas else [])
    return f"{n.kind}[{'+'.join(what)}]"


def cpu_share_mhz(node: Node) -> int:
    """Each process's equal share of its node (1000 MHz a core, as deploy render counts): what
    the prediction assumed of the router's threads."""
    return max(MIN_MHZ, node.cores * MHZ_PER_CORE // (int(node.router) + len(node.replicas)))


def group_cpu_mhz(best: Candidate) -> list[int]:
    """Each group's CPU per replica (MHz): on every node, the cores its router does not take go to
    its expert processes by the load each computes (its group's predicted share over the group's
    replicas), rounded down to 100 MHz; a group on several nodes gets the least of them, so it
    can be scheduled on any of the nodes it was predicted on."""
    per_replica = [g.load_share / best.replicas for g in best.groups]
    if sum(per_replica) <= 0:
        per_replica = [1.0] * len(best.groups)
    out = [0] * len(best.groups)
    for n in best.nodes:
        free = n.cores * MHZ_PER_CORE - (cpu_share_mhz(n) if n.router else 0)
        weight = sum(per_replica[g] for g in n.replicas) or 1.0
        for g in set(n.replicas):
            mhz = max(MIN_MHZ, int(free * per_replica[g] / weight) // 100 * 100)
            out[g] = min(out[g], mhz) if out[g] else mhz
    return out


def planned(base: Plan, profile: ProfileFile, best: Candidate, multi_kind: bool) -> Plan:
    """`base` with the candidate's expert groups, replicas, threads, resources and router settings.
    Each group keeps what `base`'s first group says of where and how to run (region, port, args;
    the device of the base's group of its name if any), not its size or placement; the router
    keeps its device."""
    raw = base.model_dump(mode="json", exclude_defaults=True)
    template = base.expert_groups[0].model_dump(
        mode="json", exclude_defaults=True, include={"region", "datacenters", "port", "args"}
    )
    groups = []
    cpus = group_cpu_mhz(best)
    for g, group in enumerate(best.groups):
        hosts = [n for n in best.nodes if g in n.replicas]
        entry = {
            **template,
            "name": group.name,
            "experts": format_experts(list(group.pairs)),
            "replicas": best.replicas,
            "device": group_device(base, group.name),
            "compute_threads": min(n.threads for n in hosts),
            "resources": {
                "cpu_mhz": cpus[g],
                "memory_mb": memory_mb(len(group.pairs), profile.expert_bytes),
            },
        }
        if multi_kind:  # the node class each group was predicted on
            entry["constraints"] = [{"attribute": "${node.class}", "value": hosts[0].kind}]
        groups.append(entry)
    raw["expert_groups"] = groups
    router = raw.setdefault("router", {})
    router.update(colocate_budget="0", max_num_seqs=best.batch, micro_batches=best.m)
    # The searched batch size and micro-batches replace what the base passed as flags.
    args, skip = [], False
    for a in router.get("args", []):
        if skip:
            skip = False
        elif a in ("--max-num-seqs", "--micro-batches"):
            skip = True
        elif not a.startswith(("--max-num-seqs=", "--micro-batches=")):
            args.append(a)
    router_node = next(n for n in best.nodes if n.router)
    # The prediction is for one router on its node.
    router["replicas"] = 1
    router.setdefault("resources", {"memory_mb": 4096})["cpu_mhz"] = cpu_share_mhz(router_node)
    if not any(a.startswith("--compute-threads") for a in args):
        args += ["--compute-threads", str(router_node.threads)]
    if best.transport == "grpc" and "ucx" in profile.transports:
        args += ["--fast-path", "off"]  # the prediction is for gRPC: deploy what was predicted
    router["args"] = args
    raw["model"].update(
        num_layers=profile.num_layers,
        num_experts=profile.num_experts,
        moe_layers=list(profile.moe_layers),
    )
    try:
        return Plan.model_validate(raw)
    except ValueError as e:
        raise PlanError(f"the proposed plan is invalid (a bug): {e}") from None


def prediction(best: Candidate, tpot_slo_s: float | None, workload: Workload = DECODE_ONLY) -> dict:
    """What `--prediction-out` writes: enough to compare with a measured run of the plan."""
    return {
        "batch_size": best.batch,
        "input_len": workload.input_len,
        "output_len": workload.output_len,
        "prefill_tokens_per_step": workload.prefill_tokens(best.batch),
        "micro_batches": best.m,
        "transport": best.transport,
        "predicted_tokens_per_s": best.tokens_per_s,
        "predicted_tpot_ms": best.step.seconds * 1e3,
        "pipeline_tpot_ms": best.step.pipeline_s * 1e3,
        "bound": best.step.bound,
        "tpot_slo_ms": None if tpot_slo_s is None else tpot_slo_s * 1e3,
        "cost_per_hour": best.cost_per_hour,
        "plan": {
            "expert_groups": [
                {
                    "name": g.name,
                    "experts": format_experts(list(g.pairs)),
                    "replicas": best.replicas,
                    "load_share": g.load_share,
                }
                for g in best.groups
            ],
            "nodes": [
                {
                    "kind": n.kind,
                    "router": n.router,
                    "expert_groups": [best.groups[g].name for g in n.replicas],
                    "threads_per_process": n.threads,
                }
                for n in best.nodes
            ],
        },
    }


def check_match(
    profile: ProfileFile, record: Record, profile_path: Path, record_path: Path
) -> None:
    """The profile and the utilization record must describe the same model."""
    for field, mine, theirs in (
        ("model_id", profile.model_id, record.model_id),
        ("num_experts", profile.num_experts, record.num_experts),
        ("moe_layers", list(profile.moe_layers), list(record.moe_layers)),
    ):
        if mine != theirs:
            raise PlanError(
                f"{record_path}: {field}: the record has {theirs!r} but the profile "
                f"{profile_path} has {mine!r}"
            )
