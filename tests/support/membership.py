"""An ExpertMembership on its own (no registry, no gateway) and registry instances that fit it."""

from __future__ import annotations

from common.checkpoint import Checkpoint
from common.registry import EXPERT_SERVICE, Instance
from router_service.build import default_model_id
from router_service.experts.backends import LivePlacement
from router_service.experts.dispatch import ExpertDispatcher
from router_service.experts.membership import ExpertMembership
from router_service.experts.remote import Identity
from router_service.experts.replicas import DispatchPolicy


def membership_of(path) -> tuple[ExpertMembership, ExpertDispatcher, Checkpoint]:
    """A membership feeding a dispatcher with no colocated experts, for the checkpoint at `path`."""
    ckpt = Checkpoint(path)
    # No hedging: a test that pauses a replica sees its calls stay in flight.
    dispatcher = ExpertDispatcher(ckpt.spec, {}, policy=DispatchPolicy(hedge_min_delay_s=60.0))
    identity = Identity(default_model_id(path), ckpt.fingerprint())
    return (
        ExpertMembership(ckpt.spec, identity, LivePlacement(dispatcher), 64 * 2**20),
        dispatcher,
        ckpt,
    )


def instance_of(
    m: ExpertMembership, name: str, port: int, experts: str = "*:0-7", **meta: str
) -> Instance:
    """A registered expert service that `m` accepts, unless `meta` overrides make it foreign."""
    base = {
        "model_id": m.identity.model_id,
        "weights_checksum": m.identity.weights_checksum,
        "experts": experts,
    }
    return Instance(EXPERT_SERVICE, name, "127.0.0.1", port, meta={**base, **meta})
