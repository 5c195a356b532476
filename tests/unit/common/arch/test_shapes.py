"""common/arch/shapes.py: the shapes config.json implies, checked from the safetensors headers
alone, for every family and layout; errors name the tensor, its shape and the config field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.arch import FAMILIES, load_spec
from common.arch.shapes import Rules, check_checkpoint, header_shapes
from common.errors import CheckpointError
from tests.support.fp8 import fp8_checkpoint


def _unruled(path: Path) -> list[str]:
    """Tensors of the checkpoint that no rule names (so whose shape goes unchecked)."""
    spec = load_spec(path)
    rules = Rules.of(spec, json.loads((path / "config.json").read_text()))
    return [n for n in header_shapes(path) if rules.expected(spec, n) is None]


def _copy_with(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    old = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**old, **config}))
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_a_correct_checkpoint_of_every_family_passes_with_every_tensor_ruled(
    checkpoint, family
) -> None:
    path = checkpoint(family)
    assert check_checkpoint(path).family == family
    assert _unruled(path) == []


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe"])
def test_fused_experts_pass(checkpoint, family) -> None:
    path = checkpoint(family, expert_layout="fused")
    check_checkpoint(path)
    assert _unruled(path) == []


def test_mxfp4_and_fp8_checkpoints_pass(checkpoint, tmp_path) -> None:
    mxfp4 = checkpoint("gpt_oss", quantize="mxfp4", dtype="bfloat16")
    check_checkpoint(mxfp4)
    assert _unruled(mxfp4) == []
    fp8 = fp8_checkpoint(checkpoint("deepseek_v3", dtype="bfloat16"), tmp_path / "fp8")
    check_checkpoint(fp8)  # the weights keep their shapes; the scales are the loader's to check
    assert all(n.endswith("weight_scale_inv") for n in _unruled(fp8))


def test_a_sharded_checkpoint_reads_every_shard(checkpoint) -> None:
    path = checkpoint("mixtral", max_shard_size=20000)
    shapes = header_shapes(path)
    assert len({file for _, file in shapes.values()}) > 1
    check_checkpoint(path)


@pytest.mark.parametrize(
    ("family", "config", "tensor", "words"),
    [
        ("mixtral", {"hidden_size": 32}, "model.embed_tokens.weight", "dim 1: hidden_size=32"),
        ("mixtral", {"vocab_size": 500}, "model.embed_tokens.weight", "dim 0: vocab_size=500"),
        (
            "qwen3_moe",
            {"moe_intermediate_size": 48},
            "model.layers.0.mlp.experts.0.down_proj.weight",
            "dim 1: moe_intermediate_size=48",
        ),
        (
            "qwen2_moe",
            {"num_key_value_heads": 4},
            "model.layers.0.self_attn.k_proj.bias",
            "num_key_value_heads=4 × hidden_size / num_attention_heads=16",
        ),
        ("olmoe", {"num_experts": 6}, "model.layers.0.mlp.experts.6.down_proj.weight", "past"),
        (
            "deepseek_v3",
            {"kv_lora_rank": 16},
            "model.layers.0.self_attn.kv_a_layernorm.weight",
            "dim 0: kv_lora_rank=16",
        ),
        ("dbrx", {"d_model": 32, "n_heads": 2}, "transformer.wte.weight", "d_model=32"),
        (
            "gpt_oss",
            {"intermediate_size": 64},
            "model.layers.0.mlp.experts.down_proj",
            "dim 1: intermediate_size=64",
        ),
        (
            "glm4_moe",
            {"intermediate_size": 64},
            "model.layers.0.mlp.down_proj.weight",  # the dense first layer
            "dim 1: intermediate_size=64",
        ),
    ],
)
def test_a_contradicting_config_names_tensor_shape_and_field(
    checkpoint, tmp_path, family, config, tensor, words
) -> None:
    path = _copy_with(checkpoint(family), tmp_path / "broken", **config)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(path)
    message = str(e.value)
    assert f"tensor {tensor!r}" in message and words in message, message
    assert str(path / "model.safetensors") in message


def test_the_first_error_is_the_models_first_tensor_and_the_others_are_counted(
    checkpoint, tmp_path
) -> None:
    path = _copy_with(checkpoint("mixtral"), tmp_path / "broken", hidden_size=32)
    with pytest.raises(
        CheckpointError, match=r"wrong shape \[512, 64\], config implies \[512, 32\]"
    ) as e:
        check_checkpoint(path)
    assert "'model.embed_tokens.weight'" in str(e.value)
    assert f"and {len(header_shapes(path)) - 1} more tensor(s)" in str(e.value)


def test_a_truncated_or_missing_file_is_named(checkpoint, tmp_path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("mixtral"), path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated") as e:
        check_checkpoint(path)
    assert str(weights) in str(e.value)
    weights.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        check_checkpoint(path)
    sharded = tmp_path / "sharded"
    shutil.copytree(checkpoint("mixtral", max_shard_size=20000), sharded)
    victim = sorted(sharded.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match="listed in the index is missing") as e:
        check_checkpoint(sharded)
    assert str(victim) in str(e.value)


def test_layers_the_config_counts_but_the_files_lack_are_missing(checkpoint, tmp_path) -> None:
    path = _copy_with(checkpoint("mixtral"), tmp_path / "deeper", num_hidden_layers=4)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(path)
    message = str(e.value)
    assert message.startswith("missing tensor (layer 3 of num_hidden_layers=4 in config.json)")
    assert "tensor 'model.layers.3.input_layernorm.weight'" in message and str(path) in message
