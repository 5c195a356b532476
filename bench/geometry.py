"""The model geometries the benches run at (`--geometry`), the cached checkpoint of each, and the
weight bytes a decoding token reads, so every bench quotes its rate against the same arithmetic.

`small` is moe-mesh's small Mixtral preset. The two slices have a published model's layer shapes
(hidden size, experts, expert FFN width, top-k, attention heads) with fewer layers, so that a
checkpoint fits this kind of host: the per-token work of a layer is the real model's, the number
of layers is not. Their vocabulary is the small preset's 8,192 tokens (the published models have
32,000 and 151,936), so that the LM head stays a few percent of the bytes a token reads instead of
dominating a slice of a few layers. They are written by `moe-mesh checkpoint create`'s function
(the family's `small` preset with `overrides`, seed 0) and stored in bfloat16 (its `dtype`): in
float32 the Mixtral slice alone is 11.9 GB, two copies of which (the engine and transformers) do
not fit a 23 GB host.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from bench import ScriptSettings
from common.arch import ModelSpec, checkpoint_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Geometry:
    name: str
    arch: str
    about: str
    directory: Path  # the cached checkpoint, created on first use
    disk_dtype: str = "float32"  # float32 | bfloat16: what the safetensors hold
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config fields over `small`'s


GEOMETRIES: dict[str, Geometry] = {
    g.name: g
    for g in (
        Geometry(
            "small",
            "mixtral",
            "the small Mixtral preset: hidden 1024, 8 layers, 8 experts of FFN 1024, top-2, "
            "GQA 16/4 (float32 on disk)",
            ROOT / ".cache/bench-small-mixtral",
        ),
        Geometry(
            "qwen3-30b-a3b-slice",
            "qwen3_moe",
            "Qwen3-30B-A3B's layers: hidden 2048, 128 experts of FFN 768, top-8, GQA 32/4, "
            "head_dim 128; 4 layers, vocabulary 8192 (bfloat16 on disk)",
            ROOT / ".cache/bench-qwen3-30b-a3b-slice",
            "bfloat16",
            dict(
                hidden_size=2048,
                num_hidden_layers=4,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                norm_topk_prob=True,  # as published
            ),
        ),
        Geometry(
            "mixtral-8x7b-slice",
            "mixtral",
            "Mixtral-8x7B's layers: hidden 4096, 8 experts of FFN 14336, top-2, GQA 32/8, "
            "head_dim 128; 2 layers, vocabulary 8192 (bfloat16 on disk)",
            ROOT / ".cache/bench-mixtral-8x7b-slice",
            "bfloat16",
            dict(
                hidden_size=4096,
                num_hidden_layers=2,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                num_local_experts=8,
                num_experts_per_tok=2,
                intermediate_size=14336,
            ),
        ),
    )
}
NAMES = tuple(GEOMETRIES)


class GeometrySettings(ScriptSettings):
    """What a bench at a `--geometry` takes: the geometry, and a checkpoint that overrides it."""

    checkpoint: Path | None = Field(
        None,
        description="checkpoint to use (created at --geometry if missing); default: the "
        "geometry's under .cache/",
    )
    geometry: Literal[NAMES] = Field("small", description="model geometry (bench/geometry.py)")  # type: ignore[valid-type]


def geometry_spec(g: Geometry) -> ModelSpec:
    """The spec `g`'s checkpoint will have, from its transformers config alone (no weights)."""
    import transformers  # here: a bench configures OpenMP before torch loads

    from moe_mesh.dev.families import CLASSES, PRESET_SIZES, config_kwargs

    preset = PRESET_SIZES["small"]
    config_cls = getattr(transformers, CLASSES[g.arch][0])
    alias = getattr(config_cls, "attribute_map", {})
    merged = {**config_kwargs(g.arch, preset, preset["vocab"]), **g.overrides}
    config = config_cls(**{alias.get(k, k): v for k, v in merged.items()}).to_dict()
    return parse_spec(config, f"geometry {g.name}")


def checkpoint_for(name: str, checkpoint: Path | None = None) -> Path:
    """The checkpoint a bench runs on: `checkpoint` if given (created with geometry `name` if
    missing), else the geometry's cached one, created on first use and checked against the
    geometry after (a cache left by another version of the table is an error, not a silent run)."""
    g = GEOMETRIES[name]
    path = g.directory if checkpoint is None else Path(checkpoint)
    if not (path / "config.json").exists():
        if path.exists() and any(path.iterdir()):
            raise SystemExit(f"{path} holds no config.json but is not empty: not a checkpoint")
        create(g, path)
    elif checkpoint is None and (wrong := mismatches(checkpoint_spec(path), geometry_spec(g))):
        raise SystemExit(
            f"{path} is not geometry {name} ({'; '.join(wrong)}): remove it to have it re-created"
        )
    return path


def mismatches(have: ModelSpec, want: ModelSpec) -> list[str]:
    fields = ("family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    fields += ("num_experts", "top_k", "expert_intermediate_size", "vocab_size")
    return [
        f"{f} {getattr(have, f)}, not {getattr(want, f)}"
        for f in fields
        if getattr(have, f) != getattr(want, f)
    ]


def create(g: Geometry, out: Path) -> None:
    """Write `g`'s checkpoint at `out`, with progress on stderr (built whole, `built_whole`)."""
    from moe_mesh.dev.create_checkpoint import create_checkpoint  # here: see geometry_spec

    print(f"[geometry] creating {g.name} at {out}: {g.about}", flush=True)
    built_whole(
        out,
        lambda partial: create_checkpoint(
            partial,
            g.arch,
            "small",
            seed=0,
            overrides=g.overrides,
            progress=True,
            dtype=g.disk_dtype,
        ),
    )
    print(f"[geometry] {g.name} ready at {out}", flush=True)


def built_whole(out: Path, build: Callable[[Path], None]) -> None:
    """A checkpoint directory `build(partial)` writes beside `out`, renamed into place when
    whole, so an interrupted run leaves no half checkpoint to reuse."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # ours, from an interrupted run
    build(partial)
    if out.exists():  # an empty directory (create_checkpoint accepts those too)
        out.rmdir()
    partial.rename(out)


def attention_params(spec: ModelSpec) -> int:
    """One layer's attention (projections, their biases and norms) and the layer's two norms."""
    h, n, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    if (m := spec.mla) is not None:  # DeepSeek's latent attention, its two latent norms
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * m.q_lora_rank + m.q_lora_rank * (1 + n * qk) if m.q_lora_rank else h * n * qk
        kv_params = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv_params += m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv_params + n * m.v_head_dim * h + 2 * h
    params = (n + 2 * kv) * hd * h + n * hd * h + 2 * h
    params += (n + 2 * kv) * hd * spec.qkv_bias + h * spec.o_bias
    norms = {"none": 0, "per_head": 2 * hd, "full": (n + kv) * hd}
    return params + norms[spec.qk_norm]


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts `batch` tokens use in one layer, each taking top_k of num_experts at
    random: E (1 - (1 - k/E)^b). Exactly top_k at batch 1; a skewed router uses fewer."""
    if batch == 1:
        return float(top_k)
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_params(spec: ModelSpec, batch: int = 1) -> float:
    """Weights one decode step of `batch` tokens reads: per layer attention, norms, gate, the
    experts its tokens use (expected_experts), shared expert or dense MLP; the LM head and final
    norm. The KV cache of a short context and the embedding rows are noise."""
    h = spec.hidden_size
    experts = expected_experts(spec.num_experts, spec.top_k, batch)
    params = float(spec.vocab_size * h + h)
    for moe in spec.moe_layers:
        params += attention_params(spec)
        if moe:
            params += spec.num_experts * h + experts * spec.expert_params
            params += 3 * (spec.shared_expert_intermediate_size or 0) * h
        else:
            params += 3 * spec.dense_intermediate_size * h
    return params


def bytes_per_token(spec: ModelSpec, itemsize: int, batch: int = 1) -> int:
    """Weight bytes read per decoded token at `batch` (a step's reads shared by its tokens), at
    the compute dtype's `itemsize`: tokens/s times this over the read bandwidth is the share of
    the bandwidth a decode used."""
    return round(step_params(spec, batch) * itemsize / batch)


def model_params(spec: ModelSpec) -> int:
    """Every weight: the embedding, each layer with all its experts, the LM head (a process
    holding the model holds this many, at its dtype)."""
    h = spec.hidden_size
    params = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2) + h
    for moe in spec.moe_layers:
        params += attention_params(spec)
        if moe:
            params += spec.num_experts * (h + spec.expert_params)
            params += 3 * (spec.shared_expert_intermediate_size or 0) * h
        else:
            params += 3 * spec.dense_intermediate_size * h
    return params
