"""`moe-mesh scale`'s guard and the launcher's control endpoint: a scale-down that would leave some
expert with no replica anywhere (no other expert service serves it, no router colocates it) is
refused, naming the experts, unless forced.

Forced, the retiring replicas still drain (expert_service/drain.py); the routers' calls that need
an expert with no replica then wait for one, up to their missing_expert_wait_s (default 30 s),
while the gateway reports not-ready, so streams in flight pause instead of failing, and resume
when a replica of the group returns.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence

from common.arch import ModelSpec
from common.placement import Pair, format_experts, parse_experts
from moe_mesh.ops.coverage import COLOCATED


class OnlyCopyError(RuntimeError):
    """The replicas a scale would stop are the only copy of `missing` (an expert spec)."""

    def __init__(self, group: str, missing: str) -> None:
        self.group, self.missing = group, missing
        super().__init__(
            f"experts {missing} would have no replica left: the replicas of {group} that this "
            "would stop are their only copy (no other expert service serves them and no router "
            "colocates them); start another copy first, or pass --force (streams that need "
            "them then wait up to the routers' --missing-expert-wait-s for a replica, and the "
            "gateway reports not-ready meanwhile)"
        )


def unserved_after(spec: ModelSpec, kept: Sequence[str], colocated: Sequence[str]) -> list[Pair]:
    """The (layer, expert) pairs some router would have no replica of, once only the expert
    services serving `kept` (expert specs) are left; `colocated` holds each router's colocated
    spec ('' for a router that colocates nothing or did not answer). No routers: only `kept`."""
    every = [(layer, e) for layer in spec.moe_layer_ids for e in range(spec.num_experts)]
    remote = {p for s in kept for p in parse_experts(s, spec)}
    missing: set[Pair] = set()
    for local in colocated or [""]:
        here = remote | set(parse_experts(local, spec)) if local.strip() else remote
        missing.update(p for p in every if p not in here)
    return sorted(missing)


def check_copies(spec: ModelSpec, group: str, kept: Sequence[str], colocated: Sequence[str]):
    """OnlyCopyError when stopping `group`'s replicas (leaving `kept`) leaves an expert unserved
    that is served now (one unserved already is not this scale's doing)."""
    before = set(unserved_after(spec, [*kept, group], colocated))
    if missing := [p for p in unserved_after(spec, kept, colocated) if p not in before]:
        raise OnlyCopyError(group, format_experts(missing))


async def colocated_specs(routers: Sequence[str], mesh: dict) -> list[str]:
    """Each router's colocated experts, from its Status ('' when it does not answer: then it is
    not counted on to hold a copy); with the client certificate `mesh` (the ready file) names."""
    from moe_mesh.ops.client import mesh_tls, router_status  # grpc: only when a scale asks

    tls = mesh_tls(mesh)
    rows = await asyncio.gather(*(router_status(r, tls) for r in routers))
    return [row.get("placement", {}).get(COLOCATED, "") for row in rows]


async def control(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    scale: Callable[[str, int, bool], dict],
) -> None:
    """The launcher's control endpoint: one JSON line in ({"experts": SPEC, "replicas": N,
    "force": bool}), one JSON line out: the scale's reply, or {"error": why} (and "missing", the
    experts a refused scale-down would leave with no replica)."""
    try:
        request = json.loads(await reader.readline())
        reply = await asyncio.to_thread(
            scale, request["experts"], int(request["replicas"]), bool(request.get("force"))
        )
    except OnlyCopyError as e:
        reply = {"error": str(e), "missing": e.missing}
    except Exception as e:  # a bad request must not take the launcher down
        reply = {"error": str(e)}
    writer.write((json.dumps(reply) + "\n").encode())
    await writer.drain()
    writer.close()
