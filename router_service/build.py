"""Assemble a router's model from a checkpoint. The local (monolithic) engine colocates every expert."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from common.checkpoint import Checkpoint
from router_service.engine import Engine
from router_service.experts import ColocatedExperts, ExpertBackend, ExpertDispatcher
from router_service.model import MoeModel
from router_service.settings import EngineSettings

DEFAULT_MAX_MODEL_LEN = 4096


def compute_dtype(name: str) -> torch.dtype | None:
    return None if name == "auto" else getattr(torch, name)


def build_model(checkpoint: Checkpoint, settings: EngineSettings,
                placement: Mapping[tuple[int, int], ExpertBackend] | None = None) -> MoeModel:
    """The dense part from `checkpoint`; experts from `placement` (default: all colocated)."""
    spec = checkpoint.spec
    if placement is None:
        pairs = checkpoint.all_expert_pairs()
        local = ColocatedExperts(checkpoint.load_experts(pairs))
        placement = {pair: local for pair in pairs}
    max_len = settings.max_model_len or min(spec.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    return MoeModel(spec, checkpoint.load_dense(), ExpertDispatcher(spec, placement), max_len)


def build_local_engine(settings: EngineSettings) -> Engine:
    """A monolithic engine: dense part and every expert in this process."""
    if settings.checkpoint is None:
        raise ValueError("settings.checkpoint is required")
    checkpoint = Checkpoint(settings.checkpoint, dtype=compute_dtype(settings.dtype))
    return Engine(build_model(checkpoint, settings), settings)
