"""`moe-mesh sizing CONFIG`: what a model's geometry costs in memory, from its config.json alone.

For any checkpoint's config.json (or one of the geometries in moe_mesh/planning/geometries.py):
the bytes one routed expert, one layer's experts, every routed expert and one of N expert groups
hold in each precision the expert services offer, the router's dense weights, and its KV cache
per 1,000 tokens of context. The byte counts follow what the services hold (common/quant.py's
`layout`, common/fp8.py, router_service/engine/kv_cache.py), not the files on disk.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import typing
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from common.arch import ModelSpec, parse_spec
from common.cli import add_settings_arguments, settings_from_args
from common.errors import MoeMeshError
from moe_mesh.planning.geometries import GEOMETRIES

PROG = "moe-mesh sizing"
PRECISIONS = ("bfloat16", "fp8", "int8", "int4-g64")
INT4_GROUP = 64  # the expert services' default --quantize-group-size
PANEL = 32  # rows of a packed panel: FP8 keeps a float32 scale per panel and block of inputs
FP8_BLOCK_INPUTS = 128  # weight_block_size's inputs when the config has none (DeepSeek-V3's)
KV_TOKENS = 1000
ROUTER_ITEMSIZE = 2  # the router holds its dense weights and KV cache in bfloat16


def _matrix_bytes(out: int, k: int, precision: str, block_inputs: int) -> int:
    """One weight [out, in] as an expert service holds it (common/quant.py `layout`)."""
    if precision == "bfloat16":
        return out * k * 2
    if precision == "int8":  # a byte a weight, a float32 scale per output row
        return out * k + out * 4
    if precision == "fp8":  # a byte a weight, a float32 scale per panel and block of inputs
        return out * k + math.ceil(out / PANEL) * math.ceil(k / block_inputs) * 4
    # int4: half a byte a weight, a bfloat16 scale per group of inputs
    return out * k // 2 + out * (k // INT4_GROUP) * 2


def expert_bytes(spec: ModelSpec, precision: str) -> int:
    """One routed expert: gate and up [inter, hidden], down [hidden, inter]; biases (gpt-oss) in
    bfloat16 whatever the weights' precision."""
    h, i = spec.hidden_size, spec.expert_intermediate_size
    block = spec.fp8_block[1] if spec.fp8_block else FP8_BLOCK_INPUTS
    weights = 2 * _matrix_bytes(i, h, precision, block) + _matrix_bytes(h, i, precision, block)
    return weights + (spec.expert_params - 3 * h * i) * 2


def attention_params(spec: ModelSpec) -> int:
    """One layer's attention: projections, their biases and norms (MLA: its low-rank factors)."""
    h, heads = spec.hidden_size, spec.num_heads
    if spec.mla is not None:
        m = spec.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:  # q_a [q_lora, hidden], its norm, q_b [heads * qk, q_lora]
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk
        else:
            q = h * heads * qk
        # kv_a [kv_lora + rope, hidden], its norm, kv_b [heads * (nope + v), kv_lora]
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h
    q, kv = heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    params = h * q + 2 * h * kv + q * h
    params += (q + 2 * kv if spec.qkv_bias else 0) + (h if spec.o_bias else 0)
    params += {"none": 0, "per_head": 2 * spec.head_dim, "full": q + kv}[spec.qk_norm]
    return params + (heads if spec.attention_sinks else 0)


def dense_params(spec: ModelSpec) -> int:
    """What the router holds: embeddings, LM head, norms, attention, gates, shared experts and
    dense MLP layers; every parameter but the routed experts'."""
    h = spec.hidden_size
    total = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2) + h
    moe = set(spec.moe_layer_ids)
    for layer in range(spec.num_layers):
        total += attention_params(spec) + 2 * h
        if layer not in moe:
            total += 3 * h * spec.dense_intermediate_size
            continue
        total += spec.num_experts * h  # the gate
        if spec.router_bias or spec.router == "sigmoid_group":  # gpt-oss; correction bias
            total += spec.num_experts
        total += 3 * h * spec.shared_expert_intermediate_size
    return total


def kv_bytes_per_token(spec: ModelSpec, itemsize: int = ROUTER_ITEMSIZE) -> int:
    """The router's KV cache entry of one token over every layer (MLA: the latent and the rope
    key, one head: ModelSpec.kv_dims)."""
    heads, kdim, vdim = spec.kv_dims
    return spec.num_layers * heads * (kdim + vdim) * itemsize


@dataclass(frozen=True)
class Sizing:
    """The numbers `moe-mesh sizing` prints; bytes unless named otherwise."""

    name: str
    moe_layers: int
    experts_per_layer: int
    top_k: int
    groups: int
    experts_per_group: int  # the largest group's (layer, expert) pairs
    expert: dict[str, int]  # per precision
    layer_experts: dict[str, int]
    all_experts: dict[str, int]
    group: dict[str, int]
    router_dense: int
    kv_per_1k_tokens: int


def sizing(spec: ModelSpec, name: str, groups: int) -> Sizing:
    pairs = len(spec.moe_layer_ids) * spec.num_experts
    per_group = -(-pairs // groups)
    one = {p: expert_bytes(spec, p) for p in PRECISIONS}
    return Sizing(
        name=name,
        moe_layers=len(spec.moe_layer_ids),
        experts_per_layer=spec.num_experts,
        top_k=spec.top_k,
        groups=groups,
        experts_per_group=per_group,
        expert=one,
        layer_experts={p: b * spec.num_experts for p, b in one.items()},
        all_experts={p: b * pairs for p, b in one.items()},
        group={p: b * per_group for p, b in one.items()},
        router_dense=dense_params(spec) * ROUTER_ITEMSIZE,
        kv_per_1k_tokens=kv_bytes_per_token(spec) * KV_TOKENS,
    )


def human(n: float) -> str:
    """Bytes in binary units, three significant figures: '336 MiB', '1.25 TiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def render(s: Sizing) -> str:
    """The table `moe-mesh sizing` prints (Markdown, so the docs page can hold it as printed)."""
    lines = [
        f"{s.name}: {s.moe_layers} MoE layers x {s.experts_per_layer} routed experts, top-{s.top_k}",
        "",
        "| experts held | " + " | ".join(PRECISIONS) + " |",
        "| --- |" + " ---: |" * len(PRECISIONS),
    ]
    rows = (
        ("one expert", s.expert),
        ("one layer's experts", s.layer_experts),
        (f"one of {s.groups} groups ({s.experts_per_group} experts)", s.group),
        ("every routed expert", s.all_experts),
    )
    lines += [
        f"| {what} | " + " | ".join(human(row[p]) for p in PRECISIONS) + " |" for what, row in rows
    ]
    lines += [
        "",
        f"router: dense weights {human(s.router_dense)} (bfloat16); KV cache "
        f"{human(s.kv_per_1k_tokens)} per {KV_TOKENS:,} tokens of context (bfloat16)",
    ]
    return "\n".join(lines)


class SizingSettings(BaseModel):
    """`moe-mesh sizing`'s arguments."""

    model_config = ConfigDict(extra="forbid")

    config: str = Field(
        description="a config.json, a checkpoint directory holding one, or one of "
        + ", ".join(GEOMETRIES),
        json_schema_extra={"metavar": "CONFIG"},
    )
    groups: int = Field(
        8,
        ge=1,
        description="expert groups the routed experts are split into",
        json_schema_extra={"metavar": "N"},
    )
    as_json: bool = Field(False, description="print JSON instead of the table")
    extend_profile: Path | None = Field(
        None,
        description="instead: a profile (`moe-mesh profile`) of a slice of this model (its layer "
        "shapes, fewer layers), extended to every layer of CONFIG for `plan --search` "
        "(moe_mesh/planning/extend.py); with --out",
        json_schema_extra={"metavar": "PROFILE"},
    )
    out: Path | None = Field(
        None, description="where the extended profile goes", json_schema_extra={"metavar": "FILE"}
    )


FLAGS = {"config": "config", "as_json": "--json"}


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `sizing` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "sizing",
        help="bytes per expert group and precision, router weights and KV cache, from config.json",
        description="Print what a model's geometry costs in memory: the bytes one expert, one "
        "layer's experts, one of --groups groups and every routed expert hold in bfloat16, fp8, "
        "int8 and int4 (scales included), the router's dense weights and its KV cache per 1,000 "
        "tokens. Reads config.json only.",
    )
    add_settings_arguments(p, SizingSettings, flags=FLAGS)
    p.set_defaults(func=run_sizing)


def load_config(text: str) -> tuple[str, dict]:
    """(name, parsed config.json) of a known geometry, a config.json, or a checkpoint directory."""
    if text in GEOMETRIES:
        return text, GEOMETRIES[text]
    path = Path(text)
    path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise MoeMeshError(
            f"{text}: cannot read ({e.strerror}); give a config.json, a checkpoint "
            f"directory or one of {', '.join(GEOMETRIES)}"
        ) from None
    except json.JSONDecodeError as e:
        raise MoeMeshError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise MoeMeshError(f"{path}: expected a JSON object")
    name = path.parent.name if path.name == "config.json" else path.stem
    return name or str(path), config


def run_sizing(args: argparse.Namespace) -> int:
    s = typing.cast(SizingSettings, settings_from_args(SizingSettings, args, flags=FLAGS))
    if (s.extend_profile is None) != (s.out is None):
        print(f"{PROG}: error: --extend-profile and --out go together", file=sys.stderr)
        return 2
    try:
        name, config = load_config(s.config)
        spec = parse_spec(config, s.config)
        if s.extend_profile is not None and s.out is not None:
            from moe_mesh.planning.extend import write_extended

            write_extended(s.extend_profile, spec, name, s.out)
            print(f"{PROG}: wrote {s.out}", file=sys.stderr)
            return 0
        result = sizing(spec, name, s.groups)
    except MoeMeshError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result), indent=1) if s.as_json else render(result))
    return 0
