"""Selective, memory-mapped checkpoint loading and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checkpoint import Checkpoint
from common.errors import CheckpointError, InvalidArgumentError, UnsupportedModelError
from common.quant import Quantization
from common.safetensors_mmap import SafetensorsFile
from common.weights import to_device


@pytest.fixture
def touched(monkeypatch) -> list[str]:
    """Names of every tensor read from a safetensors file during the test."""
    names: list[str] = []
    original = SafetensorsFile.get

    def spy(self, name):
        names.append(name)
        return original(self, name)

    monkeypatch.setattr(SafetensorsFile, "get", spy)
    return names


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_expert_subset_reads_only_those_tensors(checkpoint, touched, layout) -> None:
    ckpt = Checkpoint(checkpoint("mixtral", expert_layout=layout))
    experts = ckpt.load_experts([(1, 3)])
    assert list(experts) == [(1, 3)]
    assert all(".layers.1." in n and "experts" in n for n in touched), touched
    touched.clear()
    ckpt.load_dense()
    assert touched and not any("experts" in n for n in touched)


def test_fused_and_per_expert_layouts_load_identical_weights(checkpoint) -> None:
    a = Checkpoint(checkpoint("qwen2_moe")).load_experts([(0, 0), (2, 7)])
    b = Checkpoint(checkpoint("qwen2_moe", expert_layout="fused")).load_experts([(0, 0), (2, 7)])
    for key in a:
        for part in ("gate_up", "down"):
            assert torch.equal(getattr(a[key], part), getattr(b[key], part))


def test_unknown_expert_and_dense_layer_are_rejected(checkpoint) -> None:
    ckpt = Checkpoint(checkpoint("qwen2_moe", overrides={"mlp_only_layers": [1]}))
    with pytest.raises(CheckpointError, match="layer 1 is not a MoE layer"):
        ckpt.load_experts([(1, 0)])
    with pytest.raises(CheckpointError, match="expert 8 out of range"):
        ckpt.load_experts([(0, 8)])


# -- broken checkpoints ----------------------------------------------------------------------


@pytest.fixture
def broken(checkpoint, tmp_path) -> Path:
    """A writable copy of a single-file tiny Qwen2-MoE checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("qwen2_moe"), dst)
    return dst


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _load_all(path: Path) -> None:
    ckpt = Checkpoint(path)
    ckpt.load_dense()
    ckpt.load_experts(ckpt.all_expert_pairs())


def test_missing_tensor_names_file_and_tensor(broken) -> None:
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    _rewrite(broken, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        _load_all(broken)
    assert "missing tensor" in str(e.value) and name in str(e.value) and str(broken) in str(e.value)


def test_wrong_shape_names_file_tensor_and_both_shapes(broken) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(3, 64)

    _rewrite(broken, edit)
    with pytest.raises(CheckpointError) as e:
        _load_all(broken)
    msg = str(e.value)
    assert name in msg and "model.safetensors" in msg and "[3, 64]" in msg and "[32, 64]" in msg


def test_unsupported_architecture_names_model_type(broken) -> None:
    _edit_config(broken, lambda c: c.update(model_type="llama"))
    with pytest.raises(UnsupportedModelError, match="model_type='llama'.*config.json"):
        Checkpoint(broken)


def test_missing_config_field_names_field_and_file(broken) -> None:
    _edit_config(broken, lambda c: c.pop("hidden_size"))
    with pytest.raises(CheckpointError, match="missing config field 'hidden_size'.*config.json"):
        Checkpoint(broken)


@pytest.mark.parametrize("corrupt", ["garbage_json", "huge_length", "truncated_data", "short_file"])
def test_corrupt_safetensors_names_the_file(broken, corrupt) -> None:
    path = broken / "model.safetensors"
    data = bytearray(path.read_bytes())
    if corrupt == "garbage_json":
        data[8:24] = b"\x00not json at all"
    elif corrupt == "huge_length":
        data[:8] = (2**40).to_bytes(8, "little")
    elif corrupt == "truncated_data":
        data = data[: len(data) - 1000]
    else:
        data = data[:5]
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header") as e:
        _load_all(broken)
    assert str(path) in str(e.value)


def test_unsupported_rope_and_sliding_window_are_named(broken, checkpoint, tmp_path) -> None:
    _edit_config(
        broken, lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    )
    with pytest.raises(UnsupportedModelError, match="rope_type='longrope'"):
        Checkpoint(broken)
    mixtral = tmp_path / "mixtral"
    shutil.copytree(checkpoint("mixtral"), mixtral)
    _edit_config(mixtral, lambda c: c.update(sliding_window=16))
    with pytest.raises(UnsupportedModelError, match="sliding_window=16.*config.json"):
        Checkpoint(mixtral)


def test_index_pointing_at_missing_shard(checkpoint, tmp_path) -> None:
    dst = tmp_path / "sharded"
    shutil.copytree(checkpoint("qwen3_moe", max_shard_size="100KB"), dst)
    shard = sorted(dst.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing") as e:
        _load_all(dst)
    assert shard.name in str(e.value)


@pytest.fixture
def sharded(checkpoint, tmp_path) -> Path:
    dst = tmp_path / "sharded"
    shutil.copytree(checkpoint("qwen3_moe", max_shard_size="100KB"), dst)
    return dst


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (b"{not json", "invalid index"),
        (b"\xff\xfe garbage", "invalid index"),
        (b'{"metadata": {}}', "invalid index"),
        (b'{"weight_map": ["a"]}', "weight_map is not an object"),
        (
            b'{"weight_map": {"model.norm.weight": "../../etc/passwd"}}',
            "maps to '../../etc/passwd'",
        ),
        (b'{"weight_map": {"model.norm.weight": 7}}', "maps to 7"),
    ],
)
def test_corrupt_index_names_the_index_file(sharded, index, message) -> None:
    (sharded / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(CheckpointError, match=message) as e:
        _load_all(sharded)
    assert "model.safetensors.index.json" in str(e.value)


def test_no_shards_names_the_directory(broken) -> None:
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files") as e:
        _load_all(broken)
    assert str(broken) in str(e.value)


def test_tensor_listed_in_the_index_but_missing_from_its_shard(sharded) -> None:
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    shard = sharded / index["weight_map"][name]
    tensors = load_file(shard)
    tensors.pop(name)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor listed in the index is not in its file") as e:
        _load_all(sharded)
    assert name in str(e.value) and shard.name in str(e.value)


@pytest.mark.parametrize(
    "arch",
    ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "dbrx", "glm4_moe"],
)
def test_the_spec_knows_an_experts_size_without_loading_it(checkpoint, arch) -> None:
    ckpt = Checkpoint(checkpoint(arch), dtype=torch.bfloat16)
    [weights] = ckpt.load_experts(ckpt.all_expert_pairs()[:1]).values()
    assert ckpt.spec.expert_params * torch.bfloat16.itemsize == weights.nbytes


def test_quantized_experts_on_a_gpu_are_refused_before_any_weight_loads(checkpoint) -> None:
    with pytest.raises(InvalidArgumentError, match="^quantize: int8 experts compute on CPUs only"):
        Checkpoint(
            checkpoint("mixtral"), quantize=Quantization.parse("int8"), device=torch.device("cuda")
        )


def test_weights_on_a_device_keep_a_tied_head_shared(checkpoint) -> None:
    dense = Checkpoint(checkpoint("mixtral")).load_dense()
    dense.lm_head = dense.embed  # as a tied checkpoint holds them
    moved = to_device(dense, torch.device("meta"))
    assert moved.embed.device.type == "meta" and moved.lm_head is moved.embed
    assert all(
        t.device.type == "meta" for t in (moved.layers[0].attention.qkv, moved.layers[0].router)
    )
    assert dense.embed.device.type == "cpu"  # the original untouched
