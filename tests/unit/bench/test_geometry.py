"""bench/geometry.py: the geometry table holds the shapes of the real models they slice, the bytes a token
reads are the hand-counted ones (and the parameter counts those of real checkpoints), and a
geometry's checkpoint is created once, in bfloat16 where asked, checked when reused."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from bench import geometry
from bench.geometry import (
    GEOMETRIES,
    Geometry,
    attention_params,
    bytes_per_token,
    checkpoint_for,
    expected_experts,
    geometry_spec,
    model_params,
)
from common.arch import checkpoint_spec

# (family, hidden, layers, experts, expert FFN, top-k, query heads, KV heads, head_dim, vocab)
WANTED = {
    "small": ("mixtral", 1024, 8, 8, 1024, 2, 16, 4, 64, 8192),
    "qwen3-30b-a3b-slice": ("qwen3_moe", 2048, 4, 128, 768, 8, 32, 4, 128, 8192),
    "mixtral-8x7b-slice": ("mixtral", 4096, 2, 8, 14336, 2, 32, 8, 128, 8192),
}


@pytest.mark.parametrize("name", sorted(WANTED))
def test_each_geometry_has_the_shapes_of_the_model_it_names(name) -> None:
    s = geometry_spec(GEOMETRIES[name])
    got = (s.family, s.hidden_size, s.num_layers, s.num_experts, s.expert_intermediate_size)
    got += (s.top_k, s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size)
    assert got == WANTED[name]
    assert all(s.moe_layers)


def test_the_table_is_the_three_geometries_each_in_its_own_cache_directory() -> None:
    assert set(GEOMETRIES) == set(WANTED)
    assert len({g.directory for g in GEOMETRIES.values()}) == 3
    assert GEOMETRIES["small"].directory.name == "bench-small-mixtral"  # the existing cache
    assert GEOMETRIES["small"].disk_dtype == "float32"
    # The slices in bfloat16: the Mixtral one is 11.3 GB in float32, twice of which is no fit.
    assert GEOMETRIES["qwen3-30b-a3b-slice"].disk_dtype == "bfloat16"
    assert GEOMETRIES["mixtral-8x7b-slice"].disk_dtype == "bfloat16"
    assert geometry_spec(GEOMETRIES["qwen3-30b-a3b-slice"]).norm_topk_prob  # as published


def test_bytes_per_token_at_batch_1_are_the_hand_counted_ones() -> None:
    qwen3 = geometry_spec(GEOMETRIES["qwen3-30b-a3b-slice"])
    attention = (32 + 2 * 4) * 128 * 2048 + 32 * 128 * 2048 + 2 * 128 + 2 * 2048  # q/k norms
    layer = attention + 128 * 2048 + 8 * 3 * 2048 * 768  # gate, top-8 experts
    assert bytes_per_token(qwen3, 2) == (4 * layer + 8192 * 2048 + 2048) * 2
    mixtral = geometry_spec(GEOMETRIES["mixtral-8x7b-slice"])
    layer = (32 + 2 * 8) * 128 * 4096 + 32 * 128 * 4096 + 2 * 4096 + 8 * 4096
    layer += 2 * 3 * 4096 * 14336
    assert bytes_per_token(mixtral, 4) == (2 * layer + 8192 * 4096 + 4096) * 4


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-slice", "mixtral-8x7b-slice"])
def test_the_small_vocabulary_keeps_the_lm_head_under_a_tenth_of_a_tokens_reads(name) -> None:
    spec = geometry_spec(GEOMETRIES[name])
    assert spec.vocab_size * spec.hidden_size < 0.1 * bytes_per_token(spec, 1)


def test_the_mixtral_slice_holds_the_experts_the_brief_counts() -> None:
    spec = geometry_spec(GEOMETRIES["mixtral-8x7b-slice"])
    experts = 2 * 8 * 3 * 4096 * 14336  # 2.8 G parameters, 11.3 GB in float32
    dense = 2 * (attention_params(spec) + 8 * 4096) + 2 * 8192 * 4096 + 4096
    assert model_params(spec) == experts + dense
    assert 11.2e9 < experts * 4 < 11.4e9


def test_a_batch_shares_the_experts_it_reads_and_reads_no_more_than_all_of_them() -> None:
    assert expected_experts(8, 2, 1) == 2
    assert expected_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert expected_experts(128, 8, 1) == 8
    rising = [expected_experts(128, 8, b) for b in (1, 2, 8, 32, 256)]
    assert rising == sorted(rising) and rising[-1] < 128
    spec = geometry_spec(GEOMETRIES["qwen3-30b-a3b-slice"])
    per_token = [bytes_per_token(spec, 2, b) for b in (1, 8, 32)]
    assert per_token == sorted(per_token, reverse=True)
    # At batch 32 a step reads nearly every expert: ~all the layers' weights, shared by 32.
    everything = model_params(spec) - spec.vocab_size * spec.hidden_size  # but the embedding
    assert bytes_per_token(spec, 2, 32) == pytest.approx(everything * 2 / 32, rel=0.15)


def _tensor_params(directory, prefix: str = "") -> int:
    total = 0
    for shard in directory.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    total += _numel(f, name)
    return total


def _numel(f, name: str) -> int:
    n = 1
    for d in f.get_slice(name).get_shape():
        n *= d
    return n


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_attention_params_count_a_real_checkpoints_attention_tensors(checkpoint, arch) -> None:
    path = checkpoint(arch)
    spec = checkpoint_spec(path)
    layer0 = "model.layers.0."
    counted = _tensor_params(path, layer0 + "self_attn.")
    counted += _tensor_params(path, layer0 + "input_layernorm.")
    counted += _tensor_params(path, layer0 + "post_attention_layernorm.")
    assert attention_params(spec) == counted


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_model_params_count_every_tensor_of_a_real_checkpoint(checkpoint, arch) -> None:
    path = checkpoint(arch)
    assert model_params(checkpoint_spec(path)) == _tensor_params(path)


TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> Geometry:
    g = Geometry("tiny-slice", "qwen3_moe", "test", tmp_path / "tiny", "bfloat16", TINY)
    monkeypatch.setitem(GEOMETRIES, g.name, g)
    return g


def test_a_bfloat16_geometry_is_created_whole_once_and_reused(tiny, monkeypatch, capsys) -> None:
    partial = tiny.directory.with_name("tiny.partial")
    partial.mkdir()
    (partial / "junk").write_text("an interrupted run's")
    assert checkpoint_for(tiny.name) == tiny.directory
    assert not partial.exists()
    assert "[geometry] creating tiny-slice" in capsys.readouterr().out
    assert not geometry.mismatches(checkpoint_spec(tiny.directory), geometry_spec(tiny))
    assert json.loads((tiny.directory / "config.json").read_text())["dtype"] == "bfloat16"
    shards = list(tiny.directory.glob("*.safetensors"))
    dtypes = set()
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            dtypes |= {f.get_tensor(k).dtype for k in f.keys()}
    assert {str(d) for d in dtypes} == {"torch.bfloat16"}
    assert _tensor_params(tiny.directory) == model_params(geometry_spec(tiny))

    def no_second_creation(*args, **kwargs) -> None:
        raise AssertionError("created again")

    monkeypatch.setattr(geometry, "create", no_second_creation)
    assert checkpoint_for(tiny.name) == tiny.directory


def test_a_cache_holding_another_model_is_refused_naming_what_differs(
    tiny, checkpoint, tmp_path
) -> None:
    tiny.directory.mkdir()
    shutil.copy(checkpoint("mixtral") / "config.json", tiny.directory)
    with pytest.raises(SystemExit, match="family mixtral, not qwen3_moe"):
        checkpoint_for(tiny.name)


def test_a_given_checkpoint_is_used_as_it_is_and_a_non_checkpoint_refused(
    tiny, checkpoint, tmp_path
) -> None:
    other = checkpoint("mixtral")
    assert checkpoint_for(tiny.name, other) == other  # --checkpoint: any model, not checked
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("no config")
    with pytest.raises(SystemExit, match="not a checkpoint"):
        checkpoint_for(tiny.name, junk)
