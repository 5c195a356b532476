"""DeepSeek-V3 (also R1, V3.1): multi-head latent attention, sigmoid group-limited routing whose
correction bias picks experts but does not weigh them, ungated shared experts, dense first layers.

docs/families/deepseek_v3.md spells out what is computed from which config field.
"""

from __future__ import annotations

import torch

from common.arch.spec import (
    MLASpec,
    ModelSpec,
    TensorNames,
    common_fields,
    rope_spec,
    yarn_mscale,
)
from common.errors import CheckpointError
from common.weights import LayerWeights, MLAWeights

# transformers' attribute_map: DeepseekV3Config stores the expert count as n_routed_experts.
_ALIASES = {"num_local_experts": "n_routed_experts"}


def parse(config: dict, get) -> ModelSpec:
    fields = common_fields(config, lambda key, *default: get(_ALIASES.get(key, key), *default))
    mla = MLASpec(
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
    )
    qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    rope = rope_spec(config, interleaved=bool(get("rope_interleave", True)))
    # transformers' yarn_apply_mscale: YaRN stretches the logits too, by mscale_all_dim's factor squared.
    scale = qk_head_dim**-0.5
    if rope.scaling == "yarn" and rope.mscale_all_dim:
        mscale = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    dense = get("first_k_dense_replace", 0) or 0
    fields.update(rope=rope, num_kv_heads=fields["num_heads"], head_dim=qk_head_dim)
    return ModelSpec(
        family="deepseek_v3",
        **fields,
        qkv_bias=bool(get("attention_bias", False)),
        o_bias=bool(get("attention_bias", False)),
        qk_norm="none",
        clip_qkv=None,
        expert_intermediate_size=get("moe_intermediate_size"),
        moe_layers=tuple(i >= dense for i in range(fields["num_layers"])),
        dense_intermediate_size=get("intermediate_size"),
        shared_expert_intermediate_size=get("moe_intermediate_size")
        * (get("n_shared_experts", 0) or 0),
        **group_routing(get, fields["num_experts"], fields["top_k"]),
        mla=mla,
        attention_scale=scale,
    )


def group_routing(get, experts: int, top_k: int) -> dict:
    """The ModelSpec fields of sigmoid group-limited routing (DeepSeek-V3, and GLM-4.5 after it),
    checked: groups must split the experts evenly, 2 or more each, and the kept ones hold k."""
    n_group, topk_group = get("n_group", 1) or 1, get("topk_group", 1) or 1
    if experts % n_group or experts // n_group < 2:
        raise CheckpointError(
            f"n_group={n_group} must split the {experts} routed experts into equal groups "
            "of at least 2 (a group is ranked by its two best experts)"
        )
    if not 1 <= topk_group <= n_group:
        raise CheckpointError(f"topk_group={topk_group} must be between 1 and n_group={n_group}")
    if top_k > topk_group * (experts // n_group):
        raise CheckpointError(
            f"num_experts_per_tok={top_k} exceeds the {topk_group * (experts // n_group)} "
            f"experts of topk_group={topk_group} groups"
        )
    return dict(
        router="sigmoid_group",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        combine_in_fp32=True,  # the weights stay float32 (the router computes in float32)
    )


def names(spec: ModelSpec) -> TensorNames:
    return TensorNames(
        moe_prefixes=("mlp.",),
        expert_gate="gate_proj",
        expert_up="up_proj",
        expert_down="down_proj",
    )


# -- loading hooks (common/checkpoint.py) ------------------------------------------------------


def load_layer(ckpt, i: int) -> LayerWeights:
    """Layer i but its routed experts (which load_experts reads per expert or fused, as for Qwen)."""
    s, p = ckpt.spec, f"model.layers.{i}."
    h = s.hidden_size
    layer = LayerWeights(
        input_norm=ckpt.tensor(p + "input_layernorm.weight", (h,)),
        post_attention_norm=ckpt.tensor(p + "post_attention_layernorm.weight", (h,)),
        attention=_attention(ckpt, p + "self_attn."),
    )
    mlp = p + "mlp."
    if not s.moe_layers[i]:
        layer.dense_mlp = ckpt.ffn(
            mlp, "gate_proj", "up_proj", "down_proj", s.dense_intermediate_size
        )
        return layer
    return load_group_routed(ckpt, mlp, layer)


def load_group_routed(ckpt, mlp: str, layer: LayerWeights) -> LayerWeights:
    """A sigmoid-group MoE block under prefix `mlp`: router, correction bias, shared experts."""
    s, h = ckpt.spec, ckpt.spec.hidden_size
    layer.router = ckpt.tensor(mlp + "gate.weight", (s.num_experts, h))
    # Float32 whatever the model's dtype, as transformers keeps it (_keep_in_fp32_modules_strict).
    layer.router_correction = ckpt.tensor(
        mlp + "gate.e_score_correction_bias", (s.num_experts,), dtype=torch.float32
    )
    if s.shared_expert_intermediate_size:  # ungated: added as it is
        layer.shared_expert = ckpt.ffn(
            mlp + "shared_experts.",
            "gate_proj",
            "up_proj",
            "down_proj",
            s.shared_expert_intermediate_size,
        )
    return layer


def _attention(ckpt, p: str) -> MLAWeights:
    s, m = ckpt.spec, ckpt.spec.mla
    h, heads, bias = s.hidden_size, s.num_heads, s.qkv_bias
    q_out = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    kv_a = m.kv_lora_rank + m.qk_rope_head_dim
    if m.q_lora_rank is None:
        q_in, q_b, q_norm = ckpt.tensor(p + "q_proj.weight", (q_out, h)), None, None
        q_bias = torch.zeros(q_out, dtype=q_in.dtype) if bias else None  # q_proj has none
    else:
        q_in = ckpt.tensor(p + "q_a_proj.weight", (m.q_lora_rank, h))
        q_bias = ckpt.optional(p + "q_a_proj.bias", (m.q_lora_rank,), bias)
        q_b = ckpt.pack(ckpt.tensor(p + "q_b_proj.weight", (q_out, m.q_lora_rank)))
        q_norm = ckpt.tensor(p + "q_a_layernorm.weight", (m.q_lora_rank,))
    kv_bias = ckpt.optional(p + "kv_a_proj_with_mqa.bias", (kv_a,), bias)
    return MLAWeights(
        # Both projections of x in one GEMM, as q/k/v are for the other families.
        a=ckpt.pack(torch.cat([q_in, ckpt.tensor(p + "kv_a_proj_with_mqa.weight", (kv_a, h))])),
        a_bias=torch.cat([q_bias, kv_bias]) if bias else None,
        q_a_norm=q_norm,
        q_b=q_b,
        kv_a_norm=ckpt.tensor(p + "kv_a_layernorm.weight", (m.kv_lora_rank,)),
        # Not packed: decode reads it per head (router_service/engine/mla.py).
        kv_b=ckpt.tensor(
            p + "kv_b_proj.weight", (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        ),
        o=ckpt.pack(ckpt.tensor(p + "o_proj.weight", (h, heads * m.v_head_dim))),
        o_bias=ckpt.optional(p + "o_proj.bias", (h,), s.o_bias),
    )
