"""GLM-4.5 MoE: config parsing, the sigmoid group router and partial rotary against transformers,
the loading hook, and errors that name the broken field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, Glm4MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeRotaryEmbedding,
    Glm4MoeTopkRouter,
    apply_rotary_pos_emb,
)

from common.arch import parse_spec
from common.checkpoint import Checkpoint
from common.errors import CheckpointError, UnsupportedModelError
from common.moe import route
from common.safetensors_mmap import SafetensorsFile
from moe_mesh.planning import measure
from moe_mesh.planning.measure import LayerBench
from router_service.engine.layers import Rope

# GLM-4.5's published config.json, abridged: the rotary factor at the top level, rope_scaling null.
PUBLISHED = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 3,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1536,
    "n_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_qk_norm": True,
    "vocab_size": 151552,
}


def test_published_config() -> None:
    s = parse_spec(PUBLISHED)
    assert (s.family, s.num_experts, s.top_k, s.head_dim) == ("glm4_moe", 160, 8, 128)
    assert s.rope.rotary_dim == 64 and s.rope.scaling == "default" and s.rope_theta == 1e6
    assert (s.qkv_bias, s.o_bias, s.qk_norm) == (True, False, "per_head")
    assert s.moe_layers == (False,) * 3 + (True,) * 89
    assert (s.dense_intermediate_size, s.expert_intermediate_size) == (12288, 1536)
    assert s.shared_expert_intermediate_size == 1536
    assert (s.router, s.n_group, s.topk_group, s.routed_scaling_factor) == (
        "sigmoid_group",
        1,
        1,
        2.5,
    )
    assert s.norm_topk_prob and s.eos_token_ids == (151329, 151336, 151338)


@pytest.mark.parametrize(
    ("edit", "rotary_dim"),
    [
        # transformers 5 moves the factor into rope_parameters, which wins over the top level
        ({"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25}}, 32),
        ({"partial_rotary_factor": None}, 64),  # absent: transformers' default, 0.5
        ({"partial_rotary_factor": 1.0}, None),  # the whole head
    ],
)
def test_partial_rotary_factor_where_transformers_reads_it(edit, rotary_dim) -> None:
    config = {k: v for k, v in {**PUBLISHED, **edit}.items() if v is not None}
    assert parse_spec(config).rope.rotary_dim == rotary_dim


def test_air_like_config_without_qk_norm_groups_or_shared_expert() -> None:
    s = parse_spec(
        {
            **PUBLISHED,
            "use_qk_norm": False,
            "attention_bias": False,
            "n_group": 8,
            "topk_group": 4,
            "first_k_dense_replace": 0,
            "n_shared_experts": 2,
        }
    )
    assert (s.qk_norm, s.qkv_bias, s.n_group, s.topk_group) == ("none", False, 8, 4)
    assert all(s.moe_layers) and s.shared_expert_intermediate_size == 2 * 1536
    # the alias transformers also reads
    config = {k: v for k, v in PUBLISHED.items() if k != "n_routed_experts"}
    assert parse_spec({**config, "num_local_experts": 64}).num_experts == 64


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"n_routed_experts": None}, "missing config field 'n_routed_experts'"),
        ({"partial_rotary_factor": 0.2}, "partial_rotary_factor=0.2 rotates 25 of 128"),
        ({"n_group": 3}, "n_group=3 must split the 160 routed experts into equal groups"),
        ({"n_group": 4, "topk_group": 5}, "topk_group=5 must be between 1 and n_group=4"),
        ({"n_group": 80, "topk_group": 2}, "num_experts_per_tok=8 exceeds the 4 experts"),
        ({"n_group": 160, "topk_group": 160}, "n_group=160 must split .* groups of at least 2"),
    ],
)
def test_inconsistent_configs_name_the_field(edit, message) -> None:
    config = {k: v for k, v in {**PUBLISHED, **edit}.items() if v is not None}
    with pytest.raises(CheckpointError, match=message) as e:
        parse_spec(config)
    assert "config.json" in str(e.value)


def test_other_activations_are_unsupported() -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        parse_spec({**PUBLISHED, "hidden_act": "gelu"})


# -- the router against transformers' ---------------------------------------------------------


@pytest.mark.parametrize("reference", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize(("n_group", "topk_group", "top_k"), [(1, 1, 4), (4, 2, 3), (8, 3, 6)])
@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_group_routing_matches_transformers(
    reference, n_group, topk_group, top_k, norm
) -> None:
    experts, hidden = 32, 24
    kwargs = dict(
        hidden_size=hidden,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    if reference == "glm4_moe":
        router = Glm4MoeTopkRouter(Glm4MoeConfig(**kwargs))
    else:
        router = DeepseekV3TopkRouter(DeepseekV3Config(**kwargs))
    gen = torch.Generator().manual_seed(n_group * 10 + top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen) * 0.2)
        # about half the scores' spread: selection then differs from the plain scores'
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
        x = torch.randn(200, hidden, generator=gen)
        _, want_w, want_e = router(x)
    spec = parse_spec({**PUBLISHED, **kwargs})
    got = route(x, router.weight, spec, correction=router.e_score_correction_bias)
    assert torch.equal(got.experts, want_e) and torch.equal(got.weights, want_w)
    plain = route(x, router.weight, spec)
    assert (plain.experts.sort(-1).values != got.experts.sort(-1).values).any()


def test_partial_rotary_matches_transformers() -> None:
    config = Glm4MoeConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, partial_rotary_factor=0.25
    )
    spec = parse_spec(
        {**PUBLISHED, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
        | {"head_dim": 16, "partial_rotary_factor": 0.25, "rope_theta": 10000.0}
    )
    assert spec.rope.rotary_dim == 4
    positions = torch.tensor([0, 1, 5, 77])
    q = torch.randn(len(positions), 4, 16, generator=torch.Generator().manual_seed(0))
    k = q.flip(0)[:, :2]
    cos, sin = Glm4MoeRotaryEmbedding(config)(q, positions[None])
    # transformers' layout: [batch, heads, tokens, head_dim]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    rope = Rope(spec, 128, torch.float32)
    got = rope.rotate(torch.cat([q, k], dim=1), rope.at(positions))
    assert torch.equal(got[:, :4], want_q[0].transpose(0, 1))
    assert torch.equal(got[:, 4:], want_k[0].transpose(0, 1))
    assert torch.equal(got[..., 4:], torch.cat([q, k], dim=1)[..., 4:])  # the rest passes through


# -- loading ------------------------------------------------------------------------------------


def test_layers_load_with_router_correction_and_ungated_shared_expert(checkpoint) -> None:
    path = checkpoint("glm4_moe")
    stored = load_file(path / "model.safetensors")
    dense = Checkpoint(path, dtype=torch.bfloat16).load_dense()
    first, moe = dense.layers[0], dense.layers[1]
    assert first.dense_mlp is not None and first.router is None
    assert moe.dense_mlp is None and moe.router.shape == (8, 64)
    # float32 as transformers keeps it, whatever the model computes in, and non-zero in our files
    correction = stored["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert moe.router_correction.dtype == torch.float32 and correction.abs().min() > 0
    assert torch.equal(moe.router_correction, correction)
    assert moe.shared_expert.down.shape == (64, 96) and moe.shared_expert_gate is None
    attn = moe.attention
    assert attn.qkv_bias.shape == ((4 + 2 + 2) * 16,) and attn.o_bias is None
    assert attn.q_norm.shape == attn.k_norm.shape == (16,)


def test_correction_bias_changes_which_experts_the_test_checkpoint_picks(checkpoint) -> None:
    ckpt = Checkpoint(checkpoint("glm4_moe"))
    layer = ckpt.load_dense().layers[2]
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    corrected = route(x, layer.router, ckpt.spec, correction=layer.router_correction)
    plain = route(x, layer.router, ckpt.spec)
    changed = (corrected.experts.sort(-1).values != plain.experts.sort(-1).values).any(-1)
    assert 0.05 < changed.float().mean() < 0.6


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_experts_load_selectively_in_both_layouts(checkpoint, layout, monkeypatch) -> None:
    per_expert = Checkpoint(checkpoint("glm4_moe")).load_experts([(1, 0), (2, 7)])
    ckpt = Checkpoint(checkpoint("glm4_moe", expert_layout=layout))
    with pytest.raises(CheckpointError, match="layer 0 is not a MoE layer; MoE layers: \\[1, 2\\]"):
        ckpt.load_experts([(0, 1)])
    touched: list[str] = []
    real = SafetensorsFile.get
    monkeypatch.setattr(
        SafetensorsFile, "get", lambda f, name: touched.append(name) or real(f, name)
    )
    got = ckpt.load_experts([(1, 0), (2, 7)])
    assert touched and all(".mlp.experts." in name for name in touched), touched
    for key, w in per_expert.items():
        assert torch.equal(got[key].gate_up, w.gate_up) and torch.equal(got[key].down, w.down)


@pytest.fixture
def broken(checkpoint, tmp_path) -> Path:
    dst = tmp_path / "glm"
    shutil.copytree(checkpoint("glm4_moe"), dst)
    return dst


@pytest.mark.parametrize(
    ("name", "replacement", "message"),
    [
        ("model.layers.2.mlp.gate.e_score_correction_bias", None, "missing tensor"),
        ("model.layers.1.mlp.gate.e_score_correction_bias", torch.zeros(7), "wrong shape \\[7\\]"),
        ("model.layers.1.mlp.shared_experts.up_proj.weight", None, "missing tensor"),
        (
            "model.layers.2.mlp.shared_experts.down_proj.weight",
            torch.zeros(64, 128),
            "\\[64, 96\\]",
        ),
        ("model.layers.0.mlp.gate_proj.weight", None, "missing tensor"),
        ("model.layers.1.self_attn.q_proj.bias", None, "missing tensor"),
        ("model.layers.2.self_attn.k_norm.weight", torch.zeros(32), "wrong shape \\[32\\]"),
    ],
)
def test_broken_tensors_are_named_with_their_file(broken, name, replacement, message) -> None:
    tensors = load_file(broken / "model.safetensors")
    if replacement is None:
        tensors.pop(name)
    else:
        tensors[name] = replacement
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message) as e:
        Checkpoint(broken).load_dense()
    assert name in str(e.value) and str(broken) in str(e.value)


def test_broken_config_names_the_field_and_file(broken) -> None:
    config = json.loads((broken / "config.json").read_text())
    config["topk_group"] = 3
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="topk_group=3.*config.json"):
        Checkpoint(broken)


def test_profile_times_dense_and_moe_layers(checkpoint, monkeypatch) -> None:
    """`moe-mesh profile`'s measurements run on GLM: a dense first layer, corrected routing."""
    results = []  # what each timed function computes, run once more after its timing
    real = measure.timed

    def spy(fn, repeats, *args, **kwargs):
        timing = real(fn, repeats, *args, **kwargs)
        results.append(fn())
        return timing

    monkeypatch.setattr(measure, "timed", spy)
    bench = LayerBench(Checkpoint(checkpoint("glm4_moe"), dtype=torch.float32))
    assert bench.layer_id == 1 and bench.dense_layer(2, context=8, repeats=1) is not None
    bench.router_layer(3, context=8, repeats=1)
    bench.expert_layer(3, repeats=1)
    dense, moe, _ = results
    assert dense.shape == (2, bench.spec.hidden_size) and moe.shape == (3, bench.spec.hidden_size)
    shares = bench.load_shares(64)
    assert sorted(shares) == [1, 2] and all(
        sum(row) == pytest.approx(1.0) for row in shares.values()
    )
