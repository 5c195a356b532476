"""GLM-4.5 MoE: DeepSeek-style sigmoid routing (correction bias, expert groups, scaling factor), an
ungated shared expert, dense first layers, partial rotary, optional per-head q/k norm, q/k/v bias.

Files: the router is `mlp.gate.weight` with its `mlp.gate.e_score_correction_bias`, the shared
expert sits under `mlp.shared_experts.`, routed experts per expert or fused (the default loader's).
Multi-token-prediction layers (num_nextn_predict_layers, stored past num_hidden_layers) are not
loaded: they serve speculative decoding, not the model's own next-token logits.
"""

from __future__ import annotations

from moe_mesh.common.arch.spec import REQUIRED, ModelSpec, TensorNames, common_fields, rope_spec
from moe_mesh.common.errors import CheckpointError, UnsupportedModelError


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
    n_group, topk_group = get("n_group", 1), get("topk_group", 1)
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise CheckpointError(
            f"n_group={n_group}, topk_group={topk_group}: n_group must divide the {experts} "
            "experts and topk_group be from 1 to n_group"
        )
    if experts // n_group < 2 or fields["top_k"] > topk_group * (experts // n_group):
        raise CheckpointError(
            f"num_experts_per_tok={fields['top_k']} with n_group={n_group}, topk_group="
            f"{topk_group}: groups need 2 or more experts and the chosen groups k of them"
        )
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
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        combine_in_fp32=True,  # the sigmoid router's weights stay float32, as transformers' do
        moe_layers=tuple(i >= dense for i in range(fields["num_layers"])),
        dense_intermediate_size=get("intermediate_size"),
        shared_expert_intermediate_size=moe_width * get("n_shared_experts", 1),
        router="sigmoid_group",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
    )


def names(spec: ModelSpec) -> TensorNames:
    return TensorNames(
        moe_prefixes=("mlp.",),
        expert_gate="gate_proj",
        expert_up="up_proj",
        expert_down="down_proj",
    )


def load_layer(checkpoint, i: int):
    """Layer i without its routed experts: a dense layer is Llama-like; a MoE layer adds the router,
    its correction bias (float32 whatever the compute dtype, like transformers' buffer) and the
    ungated shared expert."""
    import torch  # here: reading a config.json needs no torch

    from moe_mesh.common.weights import LayerWeights

    s = checkpoint.spec
    if not s.moe_layers[i]:
        return checkpoint.layer(i)
    p, h, e = f"model.layers.{i}.", s.hidden_size, s.num_experts
    layer = LayerWeights(
        input_norm=checkpoint.tensor(p + "input_layernorm.weight", (h,)),
        post_attention_norm=checkpoint.tensor(p + "post_attention_layernorm.weight", (h,)),
        attention=checkpoint.attention(p + "self_attn."),
        router=checkpoint.tensor(p + "mlp.gate.weight", (e, h)),
        router_correction=checkpoint.tensor(
            p + "mlp.gate.e_score_correction_bias", (e,), dtype=torch.float32
        ),
    )
    if s.shared_expert_intermediate_size:
        layer.shared_expert = checkpoint.ffn(
            p + "mlp.shared_experts.",
            "gate_proj",
            "up_proj",
            "down_proj",
            s.shared_expert_intermediate_size,
        )
    return layer
