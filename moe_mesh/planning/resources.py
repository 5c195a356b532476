"""What the plans `moe-mesh plan` writes ask for: each expert group's CPU and memory from its own
share of the load and the bytes it holds, its device from the base plan, the plan to start from
when no `--base` is given, and the total a plan requests.

A group's memory is its experts' weights plus a process's own (PROCESS_MIB); its CPU is its share
of the CPU the expert services get in all, in proportion to the routed tokens each replica
computes, so a cold group is not given a hot group's cores (the cores a plan asks for stay what
the base plan's groups asked for together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.device import is_cuda
from moe_mesh.planning.deploy.plan import Plan
from moe_mesh.planning.eplb import GroupProposal
from moe_mesh.planning.record import Record

# A replica's memory beyond its weights: Python, torch, gRPC and UCX (an expert service of the tiny
# preset holds ~400 MiB resident)
PROCESS_MIB = 512
MHZ_PER_CORE = 1000  # as deploy render counts (Nomad MHz; compose and Kubernetes cores)
MIN_MHZ = 100  # Resources.cpu_mhz's floor
DEFAULT_IMAGE = "moe-mesh:0.1.0"


def weights_mib(pairs: int, expert_bytes: int) -> int:
    return -(-pairs * expert_bytes // 2**20)


def memory_mb(pairs: int, expert_bytes: int) -> int:
    """A replica's memory: its experts' weights and the process around them."""
    return weights_mib(pairs, expert_bytes) + PROCESS_MIB


def split_cpu(total_mhz: int, groups: Sequence[GroupProposal]) -> list[int]:
    """Each group's CPU per replica (MHz): `total_mhz` split by the load its replicas compute
    (a group's load share over its replicas), rounded to 100 MHz, at least MIN_MHZ."""
    weight = sum(g.load_share for g in groups)
    out = []
    for g in groups:
        share = g.load_share / weight if weight > 0 else 1 / len(groups)
        per_replica = total_mhz * share / g.replicas
        out.append(max(MIN_MHZ, round(per_replica / 100) * 100))
    return out


def expert_cpu_mhz(base: Plan | None, groups: Sequence[GroupProposal]) -> int:
    """The CPU all expert services get together: what the base plan's groups asked for, or
    without a base one core per replica."""
    if base is None:
        return MHZ_PER_CORE * sum(g.replicas for g in groups)
    return sum(g.resources.cpu_mhz * g.replicas for g in base.expert_groups)


def group_device(base: Plan, name: str) -> str:
    """Where a proposed group `name` computes: as the base's group of that name (a plan derived
    again from a derived one keeps each group on its device), else as the base's first group,
    like the groups' other where-and-how fields. The costs predicted are the profile's, whichever
    device that is: no GPU model is built here."""
    same = [g.device for g in base.expert_groups if g.name == name]
    return same[0] if same else base.expert_groups[0].device


def base_from_record(record: Record) -> Plan:
    """The plan to start from without `--base`: everything from the record (the model id the mesh
    served, its geometry), the rest the Plan model's defaults. The checkpoint is expected at
    /models/<model id> inside the containers."""
    return Plan.model_validate(
        {
            "image": DEFAULT_IMAGE,
            "model": {
                "checkpoint": f"/models/{record.model_id.strip('/') or 'model'}",
                "model_id": record.model_id,
                "num_layers": record.num_layers,
                "num_experts": record.num_experts,
                "moe_layers": list(record.moe_layers),
            },
            "expert_groups": [{"name": "all", "experts": "*:*"}],
        }
    )


@dataclass(frozen=True)
class Total:
    """What a plan asks for, all replicas together."""

    cores: float
    memory_mb: int
    processes: int
    gpus: int = 0

    def text(self, nodes: str = "") -> str:
        where = f" on {nodes}" if nodes else ""
        gpus = f", {self.gpus} GPU{'s' if self.gpus != 1 else ''}" if self.gpus else ""
        return (
            f"the plan asks for {self.cores:g} cores{gpus} and {self.memory_mb / 1024:.1f} GiB of "
            f"memory in all ({self.processes} processes: gateway, routers, expert services){where}"
        )


def total(plan: Plan) -> Total:
    parts = [
        (plan.gateway.resources, plan.gateway.replicas),
        (plan.router.resources, plan.router.replicas),
        *((g.resources, g.replicas) for g in plan.expert_groups),
    ]
    on_gpus = [(plan.router.device, plan.router.replicas)]
    on_gpus += [(g.device, g.replicas) for g in plan.expert_groups]
    return Total(
        cores=sum(r.cpu_mhz * n for r, n in parts) / MHZ_PER_CORE,
        memory_mb=sum(r.memory_mb * n for r, n in parts),
        processes=sum(n for _, n in parts),
        gpus=sum(n for device, n in on_gpus if is_cuda(device)),  # one a replica
    )
