"""Which (layer, expert) pairs a router's placement covers: shared by `moe-mesh status`, which flags
experts no replica serves, and `moe-mesh placement show`, which draws where each expert runs."""

from __future__ import annotations

from common.errors import InvalidArgumentError
from common.placement import ModelShape, Pair, format_experts, parse_experts

COLOCATED = "colocated"  # the placement backend name of experts computed in the router process


def pairs_of(spec: str, record: dict) -> set[Pair]:
    """The (layer, expert) pairs of an expert spec in the model of `record` (or its shape keys); '' names none."""
    if not spec.strip():
        return set()
    shape = ModelShape(record["num_layers"], record["num_experts"], tuple(record["moe_layers"]))
    return set(parse_experts(spec, shape))


def unserved(router: dict) -> str:
    """The experts no replica in a `router_status` row's placement serves, as an expert spec (''
    when none): a request routed to one of them fails, however healthy every service left is."""
    try:
        served = set().union(*(pairs_of(spec, router) for spec in router["placement"].values()))
    except InvalidArgumentError:  # a router whose shape this client cannot read: no claim
        return ""
    missing = [
        (layer, e)
        for layer in router["moe_layers"]
        for e in range(router["num_experts"])
        if (layer, e) not in served
    ]
    return format_experts(missing) if missing else ""
