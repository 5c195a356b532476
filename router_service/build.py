"""Assemble a router's model from a checkpoint and an expert placement.

With no expert services every expert is colocated (the monolithic engine); otherwise each
(layer, expert) pair is served by the expert services that serve it (from their Describe replies
or the registry), plus the router itself for pairs in the `colocate` spec and, when a colocation
budget is set, for the experts tiering finds hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import device, runtime
from common.checkpoint import Checkpoint
from common.errors import InvalidArgumentError, PreconditionError
from common.fastpath import LOOPBACK_HOSTS, ucx
from common.fastpath.auth import HelloSigner
from common.placement import format_experts, parse_experts
from common.registry import Registry
from common.resilience import EjectionPolicy
from common.telemetry import FAST_PATH_FALLBACKS, OFF, Telemetry
from common.tls import MeshTls
from common.units import parse_size
from router_service.engine.compute import ComputeThread
from router_service.engine.engine import Engine
from router_service.engine.model import MoeModel
from router_service.experts.backends import ColocatedExperts, LivePlacement, Placement
from router_service.experts.dispatch import ExpertDispatcher
from router_service.experts.fastpath import FastPathConfig
from router_service.experts.membership import ExpertMembership
from router_service.experts.remote import Identity, RemoteExperts, connect
from router_service.experts.replicas import DispatchPolicy
from router_service.experts.tiering import Tierer, TieringConfig
from router_service.experts.utilization import UtilizationWindow
from router_service.settings import RouterSettings

DEFAULT_MAX_MODEL_LEN = 4096


def compute_dtype(name: str) -> torch.dtype | None:
    return None if name == "auto" else getattr(torch, name)


def default_model_id(checkpoint: Path) -> str:
    return Path(checkpoint).resolve().name


def build_model(
    checkpoint: Checkpoint,
    settings: RouterSettings,
    placement: Placement | None = None,
    telemetry: Telemetry = OFF,
) -> MoeModel:
    """The dense part from `checkpoint`; experts from `placement` (default: all colocated)."""
    spec = checkpoint.spec
    if placement is None:
        pairs = checkpoint.all_expert_pairs()
        local = ColocatedExperts(checkpoint.load_experts(pairs))
        placement = {pair: [local] for pair in pairs}
    max_len = settings.max_model_len or min(spec.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    window = UtilizationWindow(spec.num_layers, spec.num_experts, settings.tier_window_s)
    policy = DispatchPolicy(
        call_timeout_factor=settings.expert_call_timeout_factor,
        call_timeout_min_s=settings.expert_call_timeout_min_s,
        hedge_quantile=settings.hedge_quantile,
        hedge_min_delay_s=settings.hedge_min_delay_s,
        ejection=EjectionPolicy(base_ejection_s=settings.expert_ejection_s),
        retry_budget_ratio=settings.retry_budget_ratio,
        probe_interval_s=settings.expert_probe_interval_s,
        missing_expert_wait_s=settings.missing_expert_wait_s,
    )
    compute = ComputeThread()
    dispatcher = ExpertDispatcher(
        spec,
        placement,
        settings.expert_timeout_s,
        settings.region,
        settings.region_penalty,
        window,
        telemetry,
        policy,
        compute,
    )
    model = MoeModel(
        spec,
        checkpoint.load_dense(),
        dispatcher,
        max_len,
        compute,
        serial_max_tokens=settings.serial_max_tokens,
        max_num_seqs=settings.max_num_seqs,
    )
    runtime.return_freed_heap()  # the load's temporaries: 90 MiB at the Mixtral-8x7B slice
    return model


def _open(settings: RouterSettings) -> Checkpoint:
    """The configured checkpoint at the compute dtype."""
    if settings.checkpoint is None:
        raise ValueError("settings.checkpoint is required")
    return Checkpoint(
        settings.checkpoint,
        dtype=compute_dtype(settings.dtype),
        prepack=True,
        quantize=settings.quantization,  # the experts this process holds
        quantize_dense=settings.quantize_dense,
        device=device.resolve(
            device.for_experts(settings.device, settings.quantization is not None)
        ),
    )


def _identity(settings: RouterSettings, checkpoint: Checkpoint) -> Identity:
    """What expert services must share with this router: model id and weights checksum."""
    return Identity(
        settings.model_id or default_model_id(checkpoint.path), checkpoint.fingerprint()
    )


def build_local_engine(settings: RouterSettings) -> Engine:
    """A monolithic engine: dense part and every expert in this process."""
    checkpoint = _open(settings)
    return Engine(build_model(checkpoint, settings), settings)


def tiering_config(settings: RouterSettings, checkpoint: Checkpoint) -> TieringConfig:
    """The tiering policy's budget and pins; InvalidArgumentError names the setting that is wrong."""
    pairs = checkpoint.all_expert_pairs()
    # From the spec, not from the weights: in the compute dtype, else the checkpoint's own.
    dtype = checkpoint.dtype or getattr(torch, checkpoint.spec.torch_dtype, torch.float32)
    expert_bytes = checkpoint.spec.expert_params * dtype.itemsize
    try:
        budget = parse_size(settings.colocate_budget, expert_bytes * len(pairs))
    except ValueError as e:
        raise InvalidArgumentError("colocate_budget", str(e)) from None
    hot = (
        frozenset(parse_experts(settings.colocate, checkpoint.spec))
        if settings.colocate
        else frozenset()
    )
    remote = (
        frozenset(parse_experts(settings.pin_remote, checkpoint.spec))
        if settings.pin_remote
        else frozenset()
    )
    if hot & remote:
        raise InvalidArgumentError(
            "pin_remote", f"{format_experts(sorted(hot & remote))} is also in colocate"
        )
    return TieringConfig(
        budget,
        expert_bytes,
        settings.tier_hot_factor,
        settings.tier_hysteresis,
        settings.tier_min_dwell_s,
        pinned_hot=hot,
        pinned_remote=remote,
    )


def fast_path_config(
    settings: RouterSettings, telemetry: Telemetry = OFF, tls: MeshTls | None = None
) -> FastPathConfig:
    """The router's fast-path policy, counting every fallback by cause on `telemetry`; `ucx`
    without an importable ucxx is a start-up error."""
    fallbacks = telemetry.meter.create_counter(
        FAST_PATH_FALLBACKS, description="expert calls re-sent over gRPC after UCX failed, by cause"
    )
    config = FastPathConfig(
        mode=settings.fast_path,
        timeout_s=settings.fast_path_timeout_s,
        backoff_s=settings.fast_path_backoff_s,
        loopback=settings.host in LOOPBACK_HOSTS,
        on_fallback=lambda cause: fallbacks.add(1, {"moe.cause": cause}),
        signer=HelloSigner.from_tls(tls) if tls else None,
    )
    if config.mode == "ucx" and not config.enabled():
        raise PreconditionError(f"fast_path: 'ucx' cannot run: {ucx.unavailable}")
    return config


@dataclass
class RouterParts:
    """A router's engine and what feeds its placement: static remotes or registry membership, and tiering."""

    engine: Engine
    tierer: Tierer
    remotes: list[RemoteExperts] = field(
        default_factory=list
    )  # static expert services, closed on stop
    membership: ExpertMembership | None = None
    tls: MeshTls | None = None  # the mesh identity it calls expert services with, and serves with


async def build_router(
    settings: RouterSettings, registry: Registry | None = None, telemetry: Telemetry = OFF
) -> RouterParts:
    """An engine whose experts live in expert services (static endpoints, or the registry followed live),
    in the `colocate` spec, and in tiering's budget. With neither endpoints nor registry it is monolithic.
    Waits until every expert has a replica."""
    tls = MeshTls.from_settings(settings)  # first: a bad certificate file fails before any load
    checkpoint = _open(settings)
    config = tiering_config(settings, checkpoint)
    model = build_model(checkpoint, settings, placement={}, telemetry=telemetry)
    if registry is None and not settings.expert_endpoints:
        config = TieringConfig(
            0, config.expert_bytes, pinned_hot=frozenset(checkpoint.all_expert_pairs())
        )
    placement = LivePlacement(
        model.dispatcher, ColocatedExperts(checkpoint.load_experts(config.pinned_hot))
    )
    tierer = Tierer(
        checkpoint, placement, model.dispatcher.window, config, settings.tier_interval_s
    )
    identity = _identity(settings, checkpoint)
    fast_path = fast_path_config(settings, telemetry, tls)
    if registry is not None:
        membership = ExpertMembership(
            checkpoint.spec,
            identity,
            placement,
            settings.max_message_bytes,
            telemetry.client_interceptors(),
            fast_path,
            tls,
        )
        await membership.start(registry, settings.connect_timeout_s)
        return RouterParts(Engine(model, settings), tierer, membership=membership, tls=tls)
    remote = (
        await connect(
            settings.expert_endpoints,
            identity,
            settings.max_message_bytes,
            settings.connect_timeout_s,
            telemetry.client_interceptors(),
            fast_path,
            tls,
        )
        if settings.expert_endpoints
        else {}
    )
    placement.set_remote(remote)
    missing = placement.missing(checkpoint.all_expert_pairs())
    backends = sorted(
        {id(b): b for bs in remote.values() for b in bs}.values(), key=lambda b: b.address
    )
    if missing:
        for b in backends:
            await b.close()
        raise PreconditionError(
            f"no expert service serves {format_experts(missing)} and they are not colocated "
            "(add expert services or --colocate)"
        )
    return RouterParts(Engine(model, settings), tierer, remotes=backends, tls=tls)
