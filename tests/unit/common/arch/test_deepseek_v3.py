"""DeepSeek-V3: what a published config.json means, the loading hooks (latent attention, router
with its correction bias, ungated shared experts, dense first layers, per-expert or fused experts),
and errors that name the culprit."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.arch import parse_spec
from common.checkpoint import Checkpoint
from common.errors import CheckpointError, UnsupportedModelError
from common.moe import route
from common.safetensors_mmap import SafetensorsFile
from common.weights import MLAWeights

# DeepSeek-V3's published config.json (also R1's and V3.1's), without its FP8 quantization_config.
V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_the_published_v3_config() -> None:
    s = parse_spec(V3_CONFIG)
    assert (s.family, s.router, s.num_experts, s.top_k) == ("deepseek_v3", "sigmoid_group", 256, 8)
    assert (s.n_group, s.topk_group, s.routed_scaling_factor, s.norm_topk_prob) == (8, 4, 2.5, True)
    assert s.moe_layers == (False,) * 3 + (True,) * 58  # the MTP layer (61) is not one of them
    assert (s.dense_intermediate_size, s.expert_intermediate_size) == (18432, 2048)
    assert s.shared_expert_intermediate_size == 2048
    assert (s.mla.q_lora_rank, s.mla.kv_lora_rank, s.mla.v_head_dim) == (1536, 512, 128)
    assert s.kv_dims == (1, 512, 64)  # one latent and one rope key per token and layer
    r = s.rope
    assert (r.scaling, r.factor, r.original_max_position_embeddings, r.interleaved) == (
        "yarn",
        40.0,
        4096,
        True,
    )
    mscale = 0.1 * math.log(40) + 1
    assert s.attention_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)


def test_optional_fields_take_transformers_defaults() -> None:
    config = {**V3_CONFIG, "q_lora_rank": None}
    for key in ("first_k_dense_replace", "rope_scaling", "n_shared_experts", "rope_interleave"):
        config.pop(key, None)
    s = parse_spec(config)
    assert s.mla.q_lora_rank is None and all(s.moe_layers)
    assert s.shared_expert_intermediate_size == 0 and s.rope.interleaved
    assert s.attention_scale == 192**-0.5


# What DeepSeek-V3's published config.json says of its FP8 weights.
FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def test_fp8_checkpoints_are_read_as_published_and_other_formats_refused() -> None:
    assert parse_spec({**V3_CONFIG, "quantization_config": FP8}).fp8_block == (128, 128)
    assert parse_spec(V3_CONFIG).fp8_block is None
    for edit, message in [
        (
            {"quant_method": "awq"},
            r"quant_method='awq' is not supported for deepseek_v3; supported: fp8",
        ),
        ({"activation_scheme": "static"}, "activation_scheme='static'; supported: e4m3 weights"),
        ({"fmt": "e5m2"}, "fmt='e5m2'"),
        (
            {"weight_block_size": [128, 100]},
            r"weight_block_size=\[128, 100\]: expected two multiples",
        ),
        ({"weight_block_size": None}, "weight_block_size=None"),
    ]:
        config = {**V3_CONFIG, "quantization_config": {**FP8, **edit}}
        with pytest.raises(UnsupportedModelError, match=f"{message}.*config.json"):
            parse_spec(config)


@pytest.mark.parametrize(
    ("fields", "culprit"),
    [
        ({"n_group": 3}, "n_group=3"),  # 256 experts do not split in 3
        ({"n_group": 256}, "n_group=256"),  # groups of one: a group is ranked by its best two
        ({"topk_group": 9}, "topk_group=9"),
        ({"topk_group": 1, "num_experts_per_tok": 33}, "num_experts_per_tok=33"),
    ],
)
def test_inconsistent_groups_name_the_field(fields: dict, culprit: str) -> None:
    with pytest.raises(CheckpointError, match=f"{culprit}.*config.json"):
        parse_spec({**V3_CONFIG, **fields})


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_rope_head_dim", "n_routed_experts"])
def test_a_missing_field_is_named(field: str) -> None:
    config = dict(V3_CONFIG)
    config.pop(field)
    with pytest.raises(CheckpointError, match=f"missing config field '{field}'.*config.json"):
        parse_spec(config)


@pytest.mark.parametrize(
    ("experts", "n_group", "topk_group", "k", "norm", "scaling"),
    [(8, 4, 2, 2, True, 2.5), (12, 3, 1, 3, False, 1.5), (16, 1, 1, 4, True, 1.0)],
)
def test_routing_is_transformers_routing(experts, n_group, topk_group, k, norm, scaling) -> None:
    """common/moe.py's sigmoid_group rule against transformers' DeepseekV3TopkRouter: the same
    experts in the same order, the same weights, the correction bias steering the choice only."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    fields = dict(
        n_routed_experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=k,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )
    spec = parse_spec({**V3_CONFIG, **fields, "hidden_size": 32, "num_attention_heads": 4})
    gen = torch.Generator().manual_seed(experts)
    hf = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=32, **fields))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(experts, 32, generator=gen) * 0.1)
        hf.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.05)
    x = torch.randn(64, 32, generator=gen)
    _, hf_weights, hf_experts = hf(x)
    ours = route(x, hf.weight.detach(), spec, correction=hf.e_score_correction_bias)
    assert torch.equal(ours.experts, hf_experts) and torch.equal(ours.weights, hf_weights)
    plain = route(x, hf.weight.detach(), spec)  # without the bias, other experts win somewhere
    assert not torch.equal(plain.experts.sort().values, ours.experts.sort().values)
    scores = torch.sigmoid(x @ hf.weight.detach().T).gather(1, ours.experts)
    if norm:
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    assert torch.allclose(ours.weights, scores * scaling)  # weighed by the uncorrected scores


# -- loading ------------------------------------------------------------------------------------


def test_dense_part_holds_latent_attention_router_correction_and_shared_expert(checkpoint) -> None:
    path = checkpoint("deepseek_v3", overrides={"first_k_dense_replace": 1})
    ckpt = Checkpoint(path, dtype=torch.bfloat16)
    s, dense = ckpt.spec, ckpt.load_dense()
    stored = load_file(path / "model.safetensors")
    dense_layer, moe_layer = dense.layers[0], dense.layers[1]
    assert dense_layer.dense_mlp is not None and dense_layer.router is None
    assert dense_layer.dense_mlp.down.shape == (64, 128)
    a = moe_layer.attention
    assert isinstance(a, MLAWeights)
    assert a.a.shape == (48 + 32 + 8, 64) and a.q_b.shape == (4 * 24, 48)
    assert a.kv_b.shape == (4 * (16 + 16), 32) and a.o.shape == (64, 4 * 16)
    assert a.a_bias is None and a.o_bias is None
    # transformers keeps e_score_correction_bias in float32 whatever the model's dtype.
    correction = stored["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert moe_layer.router_correction.dtype == torch.float32
    assert torch.equal(moe_layer.router_correction, correction) and correction.abs().sum() > 0
    assert moe_layer.shared_expert.down.shape == (64, 96)
    assert moe_layer.shared_expert_gate is None  # added ungated
    assert s.moe_layer_ids == [1, 2]


@pytest.fixture
def touched(monkeypatch) -> list[str]:
    names: list[str] = []
    original = SafetensorsFile.get

    def spy(self, name):
        names.append(name)
        return original(self, name)

    monkeypatch.setattr(SafetensorsFile, "get", spy)
    return names


def test_an_expert_subset_reads_only_its_tensors_in_either_layout(checkpoint, touched) -> None:
    loaded = []
    for layout in ("per_expert", "fused"):
        ckpt = Checkpoint(checkpoint("deepseek_v3", seed=3, expert_layout=layout))
        touched.clear()
        loaded.append(ckpt.load_experts([(1, 3), (2, 6)]))
        assert touched and all(".mlp.experts." in n for n in touched), touched
        touched.clear()
        ckpt.load_dense()
        assert touched and not any(".mlp.experts." in n for n in touched)
    per_expert, fused = loaded
    for key in per_expert:
        assert torch.equal(per_expert[key].gate_up, fused[key].gate_up)
        assert torch.equal(per_expert[key].down, fused[key].down)


def test_a_dense_layer_has_no_experts_to_load(checkpoint) -> None:
    ckpt = Checkpoint(checkpoint("deepseek_v3", overrides={"first_k_dense_replace": 1}))
    with pytest.raises(CheckpointError, match="layer 0 is not a MoE layer; MoE layers: \\[1, 2\\]"):
        ckpt.load_experts([(0, 0)])


@pytest.fixture
def broken(checkpoint, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("deepseek_v3"), dst)
    return dst


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.2.self_attn.q_a_layernorm.weight",
        "model.layers.0.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.shared_experts.up_proj.weight",
    ],
)
def test_a_missing_tensor_is_named_with_its_file(broken, name) -> None:
    _rewrite(broken, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        Checkpoint(broken).load_dense()
    assert name in str(e.value) and str(broken) in str(e.value)


def test_a_latent_of_the_wrong_width_names_tensor_and_shapes(broken) -> None:
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"

    def edit(t):
        t[name] = torch.zeros(24, 64)  # kv_lora_rank 16 + rope 8, the config says 32 + 8

    _rewrite(broken, edit)
    with pytest.raises(
        CheckpointError, match="wrong shape \\[24, 64\\], config implies \\[40, 64\\]"
    ) as e:
        Checkpoint(broken).load_dense()
    assert name in str(e.value) and "model.safetensors" in str(e.value)


def test_a_plain_q_proj_is_loaded_when_q_lora_rank_is_null(broken) -> None:
    config = json.loads((broken / "config.json").read_text())
    config["q_lora_rank"] = None
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        Checkpoint(broken).load_dense()
    assert "model.layers.0.self_attn.q_proj.weight" in str(e.value)
