"""Architecture specs: what a HuggingFace config.json means to moe-mesh, one file per family.

Each family module defines `parse(config, get) -> ModelSpec` and `names(spec) -> TensorNames`.
`get(key, default=REQUIRED)` raises a CheckpointError naming config.json and the missing field.

A family whose files differ from the Llama-like layout of the first four may also define, for
common/checkpoint.py:
  DENSE_NAMES = (embedding, final norm): tensor names, if not model.embed_tokens / model.norm
  load_layer(checkpoint, i) -> LayerWeights: everything of layer i but its routed experts
  load_expert(checkpoint, layer, expert) -> FFNWeights: one routed expert
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from common.arch.spec import REQUIRED, ModelSpec, TensorNames
from common.errors import CheckpointError, UnsupportedModelError

__all__ = ["ModelSpec", "TensorNames", "load_spec", "parse_spec", "family_module", "FAMILIES"]

FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "gpt_oss",
    "dbrx",
    "glm4_moe",
)


def family_module(model_type: str) -> Any:
    from common.arch import (
        dbrx,
        deepseek_v3,
        glm4_moe,
        gpt_oss,
        mixtral,
        olmoe,
        qwen2_moe,
        qwen3_moe,
    )

    return {
        "mixtral": mixtral,
        "qwen2_moe": qwen2_moe,
        "qwen3_moe": qwen3_moe,
        "olmoe": olmoe,
        "deepseek_v3": deepseek_v3,
        "gpt_oss": gpt_oss,
        "dbrx": dbrx,
        "glm4_moe": glm4_moe,
    }[model_type]


def parse_spec(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Build the ModelSpec of a parsed config.json; errors name `source` and the field."""

    def get(key: str, default: Any = REQUIRED) -> Any:
        value = config.get(key, default)
        if value is REQUIRED or (value is None and default is REQUIRED):
            raise CheckpointError(f"missing config field {key!r}", file=source)
        return value

    model_type = get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r}; supported: {', '.join(FAMILIES)}",
            file=source,
        )
    try:
        spec = family_module(model_type).parse(config, get)
        spec = dataclasses.replace(spec, fp8_block=_fp8_block(model_type, config))
    except CheckpointError as e:
        if e.file is None:
            raise type(e)(str(e), file=source) from e
        raise
    if spec.top_k > spec.num_experts:
        raise CheckpointError(
            f"num_experts_per_tok={spec.top_k} exceeds the {spec.num_experts} experts", file=source
        )
    return spec


# quantization_config.quant_method -> the families whose checkpoints are read in that format (not
# FP8 for the two whose experts load through a hook of their own: common/arch/dbrx.py, gpt_oss.py)
QUANT_METHODS = {
    "fp8": tuple(f for f in FAMILIES if f not in ("dbrx", "gpt_oss")),
    "mxfp4": ("gpt_oss",),
}


def _fp8_block(model_type: str, config: dict[str, Any]) -> tuple[int, int] | None:
    """An FP8 checkpoint's weight_block_size (DeepSeek-V3's layout: e4m3 weights, a float32
    weight_scale_inv per block); None for one that is not FP8. UnsupportedModelError naming the
    field for a format this mesh does not read."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if model_type not in QUANT_METHODS.get(method, ()):
        supported = [m for m, families in QUANT_METHODS.items() if model_type in families]
        raise UnsupportedModelError(
            f"quantization_config.quant_method={method!r} is not supported for {model_type}; "
            f"supported: {', '.join(supported)}"
        )
    if method != "fp8":
        return None
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError(
            f"quantization_config: fmt={q.get('fmt')!r}, activation_scheme="
            f"{q.get('activation_scheme')!r}; supported: e4m3 weights, dynamic activations"
        )
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 and b % 32 == 0 for b in block)
    ):
        raise UnsupportedModelError(
            f"quantization_config.weight_block_size={block!r}: expected two multiples of 32, "
            "e.g. [128, 128] (per-tensor or per-channel FP8 scales are not read)"
        )
    return block[0], block[1]


def checkpoint_spec(checkpoint_dir: Path) -> ModelSpec:
    """The spec of the checkpoint in `checkpoint_dir`, from its config.json alone (torch-free): a
    command refuses a wrong --checkpoint before it imports torch."""
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointError("checkpoint directory not found", file=str(checkpoint_dir))
    return load_spec(checkpoint_dir)


def load_spec(checkpoint_dir: Path) -> ModelSpec:
    """Read and parse `checkpoint_dir/config.json`."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError("config.json not found", file=str(path)) from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"config.json is not valid JSON ({e})", file=str(path)) from e
    return parse_spec(config, str(path))


def tensor_names(spec: ModelSpec) -> TensorNames:
    return family_module(spec.family).names(spec)
