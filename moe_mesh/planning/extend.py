"""A profile of a model's slice, extended to the whole model (`moe-mesh sizing CONFIG
--extend-profile SLICE --out FILE`), for `plan --search` on a model this host cannot hold.

A slice has the model's layer shapes and fewer layers (bench/geometry.py's `*-slice` geometries),
so its per-layer costs (Ta, Te, a dense layer, the transfers) are the model's. The whole model
repeats them over its layers: the MoE layer ids and the experts' load shares (the slice's layers'
shares, cyclically) are the model's, the router's dense bytes are counted from its config
(moe_mesh/planning/sizing.py), and the LM head's cost is scaled by the vocabulary (the slices
keep a small one). A first-order prediction: layers of one shape cost the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.arch import ModelSpec, load_spec
from common.errors import MoeMeshError
from moe_mesh.planning.deploy.plan import PlanError
from moe_mesh.planning.profile_format import Measured, ProfileFile, read_profile
from moe_mesh.planning.sizing import dense_params

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _scaled(m: Measured, factor: float) -> Measured:
    raw = m.model_dump()
    for fit in ("wall", "cpu"):
        raw[fit] = {k: v * factor for k, v in raw[fit].items()}
    for p in raw["points"]:
        p["wall_s"], p["cpu_s"] = p["wall_s"] * factor, p["cpu_s"] * factor
    return Measured.model_validate(raw)


def extended(
    profile: ProfileFile, slice_spec: ModelSpec, spec: ModelSpec, name: str
) -> ProfileFile:
    """`profile` (of a checkpoint of `slice_spec`) as if measured on a model of `spec`."""
    itemsize = _ITEMSIZE[profile.dtype]
    for field, mine, theirs in (
        ("hidden_size", profile.hidden_size, spec.hidden_size),
        ("num_experts", profile.num_experts, spec.num_experts),
        ("top_k", profile.top_k, spec.top_k),
        ("expert_bytes", profile.expert_bytes, spec.expert_params * itemsize),
    ):
        if mine != theirs:
            raise PlanError(f"{field}: the profile's slice has {mine}, the model {theirs}")
    moe = spec.moe_layer_ids
    shares = [profile.expert_load_shares[str(layer)] for layer in profile.moe_layers]
    raw = profile.model_dump()
    raw.update(
        model_id=name,
        num_layers=spec.num_layers,
        moe_layers=moe,
        expert_load_shares={str(layer): shares[i % len(shares)] for i, layer in enumerate(moe)},
        dense_bytes=dense_params(spec) * itemsize,
        head=_scaled(profile.head, spec.vocab_size / slice_spec.vocab_size).model_dump(),
    )
    if len(moe) < spec.num_layers and profile.dense is None:
        raise PlanError("the model has dense layers, the profile's slice none to time them by")
    return ProfileFile.model_validate(raw)


def write_extended(path: Path, spec: ModelSpec, name: str, out: Path) -> None:
    """Read the slice's profile (and its checkpoint's config), write the whole model's."""
    profile = read_profile(path)
    try:
        slice_spec = load_spec(Path(profile.checkpoint))
    except MoeMeshError as e:
        raise PlanError(f"{path}: checkpoint {profile.checkpoint}: {e}") from None
    text = json.dumps(extended(profile, slice_spec, spec, name).model_dump(mode="json"), indent=1)
    try:
        out.write_text(text + "\n")
    except OSError as e:
        raise PlanError(f"--out {out}: {e.strerror}") from None
