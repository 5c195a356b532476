"""GLM-4.5 MoE: DeepSeek-style sigmoid routing (correction bias, expert groups, scaling factor), an
ungated shared expert, dense first layers, partial rotary, optional per-head q/k norm, q/k/v bias.

Files: the router is `mlp.gate.weight` with its `mlp.gate.e_score_correction_bias`, the shared
expert sits under `mlp.shared_experts.`, routed experts per expert or fused (the default loader's).
Multi-token-prediction layers (num_nextn_predict_layers, stored past num_hidden_layers) are not
loaded: they serve speculative decoding, not the model's own next-token logits.
"""

from __future__ import annotations

from common.arch.deepseek_v3 import group_routing, load_group_routed
from common.arch.spec import REQUIRED, ModelSpec, TensorNames, common_fields, rope_spec
from common.errors import CheckpointError, UnsupportedModelError
from common.weights import LayerWeights


def parse(config: dict, get) -> ModelSpec:
    if get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={config['hidden_act']!r} is not supported")

    def aliased(key: str, default=REQUIRED):
        # transformers' attribute_map: GLM's config.json spells the expert count n_routed_experts.
        if key == "num_local_experts":
            return config.get(key) or get("n_routed_experts")
        return get(key, default)

    fields = common_fields(config, aliased)
    head_dim, experts = fields["head_dim"], fields["num_experts"]
    # transformers 5 keeps the factor in rope_parameters; published files have it at the top level.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    rotary = int(head_dim * factor)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise CheckpointError(
            f"partial_rotary_factor={factor} rotates {rotary} of {head_dim} head dims; "
            "expected an even number from 2 to head_dim"
        )
    fields["rope"] = rope_spec(config, rotary_dim=rotary if rotary < head_dim else None)
    dense = get("first_k_dense_replace", 1)
    moe_width = get("moe_intermediate_size")
    bias = bool(get("attention_bias", False))
    return ModelSpec(
        family="glm4_moe",
        **fields,
        qkv_bias=bias,  # o_proj never has one
        o_bias=False,
        qk_norm="per_head" if get("use_qk_norm", False) else "none",
        clip_qkv=None,
        expert_intermediate_size=moe_width,
        moe_layers=tuple(i >= dense for i in range(fields["num_layers"])),
        dense_intermediate_size=get("intermediate_size"),
        shared_expert_intermediate_size=moe_width * get("n_shared_experts", 1),
        **group_routing(get, experts, fields["top_k"]),
    )


def names(spec: ModelSpec) -> TensorNames:
    return TensorNames(
        moe_prefixes=("mlp.",),
        expert_gate="gate_proj",
        expert_up="up_proj",
        expert_down="down_proj",
    )


def load_layer(checkpoint, i: int) -> LayerWeights:
    """Layer i without its routed experts: a dense layer is Llama-like; a MoE layer adds the router,
    its correction bias (float32 whatever the compute dtype, like transformers' buffer) and the
    ungated shared expert."""
    s = checkpoint.spec
    if not s.moe_layers[i]:
        return checkpoint.layer(i)
    p, h = f"model.layers.{i}.", s.hidden_size
    layer = LayerWeights(
        input_norm=checkpoint.tensor(p + "input_layernorm.weight", (h,)),
        post_attention_norm=checkpoint.tensor(p + "post_attention_layernorm.weight", (h,)),
        attention=checkpoint.attention(p + "self_attn."),
    )
    return load_group_routed(checkpoint, p + "mlp.", layer)
