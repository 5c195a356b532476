"""Assemble a router's model from a checkpoint and an expert placement.

With no expert services every expert is colocated (the monolithic engine); otherwise each
(layer, expert) pair is served by the expert services that Describe it, plus the router itself
for pairs in the `colocate` spec.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.checkpoint import Checkpoint
from common.errors import PreconditionError
from common.placement import format_experts, parse_experts
from router_service.engine import Engine
from router_service.experts import ColocatedExperts, ExpertBackend, ExpertDispatcher, Placement
from common.registry import Membership, Registry
from router_service.membership import ExpertMembership
from router_service.model import MoeModel
from router_service.remote import Identity, RemoteExperts, connect
from router_service.settings import RouterSettings

DEFAULT_MAX_MODEL_LEN = 4096


def compute_dtype(name: str) -> torch.dtype | None:
    return None if name == "auto" else getattr(torch, name)


def default_model_id(checkpoint: Path) -> str:
    return Path(checkpoint).resolve().name


def build_model(checkpoint: Checkpoint, settings: RouterSettings, placement: Placement | None = None) -> MoeModel:
    """The dense part from `checkpoint`; experts from `placement` (default: all colocated)."""
    spec = checkpoint.spec
    if placement is None:
        pairs = checkpoint.all_expert_pairs()
        local = ColocatedExperts(checkpoint.load_experts(pairs))
        placement = {pair: [local] for pair in pairs}
    max_len = settings.max_model_len or min(spec.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    dispatcher = ExpertDispatcher(spec, placement, settings.expert_timeout_s)
    return MoeModel(spec, checkpoint.load_dense(), dispatcher, max_len)


def _open(settings: RouterSettings) -> Checkpoint:
    """The configured checkpoint at the compute dtype."""
    if settings.checkpoint is None:
        raise ValueError("settings.checkpoint is required")
    return Checkpoint(settings.checkpoint, dtype=compute_dtype(settings.dtype))


def _identity(settings: RouterSettings, checkpoint: Checkpoint) -> Identity:
    """What expert services must share with this router: model id and weights checksum."""
    return Identity(settings.model_id or default_model_id(checkpoint.path), checkpoint.fingerprint())


def build_local_engine(settings: RouterSettings) -> Engine:
    """A monolithic engine: dense part and every expert in this process."""
    checkpoint = _open(settings)
    return Engine(build_model(checkpoint, settings), settings)


async def build_registry_engine(settings: RouterSettings, registry: Registry) -> tuple[Engine, ExpertMembership]:
    """An engine whose remote experts follow the registry live; waits until every expert is placed."""
    checkpoint = _open(settings)
    identity = _identity(settings, checkpoint)
    colocated_pairs = parse_experts(settings.colocate, checkpoint.spec) if settings.colocate else []
    local = ColocatedExperts(checkpoint.load_experts(colocated_pairs)) if colocated_pairs else None
    model = build_model(checkpoint, settings, placement={})
    membership = ExpertMembership(checkpoint.spec, identity, model.dispatcher, local, settings.max_message_bytes)
    if local is not None:
        membership.apply(Membership((), 0))
    await membership.start(registry, settings.connect_timeout_s)
    return Engine(model, settings), membership


async def build_mesh_engine(settings: RouterSettings) -> tuple[Engine, list[RemoteExperts]]:
    """An engine whose experts live in expert services (and the `colocate` spec); returns the remote backends too."""
    checkpoint = _open(settings)
    identity = _identity(settings, checkpoint)
    remote = await connect(settings.expert_endpoints, identity, settings.max_message_bytes,
                           settings.connect_timeout_s) if settings.expert_endpoints else {}
    everything = checkpoint.all_expert_pairs()
    if settings.colocate:
        colocated = parse_experts(settings.colocate, checkpoint.spec)
    else:
        colocated = [] if remote else everything
    missing = sorted(set(everything) - set(remote) - set(colocated))
    if missing:
        raise PreconditionError(f"no expert service serves {format_experts(missing)} and they are not colocated "
                                "(add expert services or --colocate)")
    local = ColocatedExperts(checkpoint.load_experts(colocated))
    placement: dict[tuple[int, int], list[ExpertBackend]] = {
        pair: ([local] if pair in local.weights else []) + list(remote.get(pair, [])) for pair in everything}
    backends = sorted({id(b): b for bs in remote.values() for b in bs}.values(), key=lambda b: b.address)
    return Engine(build_model(checkpoint, settings, placement), settings), backends
