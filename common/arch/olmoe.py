"""OLMoE: RMSNorm on the whole q and k projections, optional clip_qkv, norm_topk_prob off by default."""

from __future__ import annotations

from common.arch.spec import ModelSpec, TensorNames, common_fields


def parse(config: dict, get) -> ModelSpec:
    fields = common_fields(config, get)
    bias = bool(get("attention_bias", False))
    clip = config.get("clip_qkv")
    return ModelSpec(
        family="olmoe",
        **fields,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=float(clip) if clip is not None else None,
        expert_intermediate_size=get("intermediate_size"),
        norm_topk_prob=bool(get("norm_topk_prob", False)),
        combine_in_fp32=False,
        moe_layers=(True,) * fields["num_layers"],
        dense_intermediate_size=0,
        shared_expert_intermediate_size=0,
    )


def names(spec: ModelSpec) -> TensorNames:
    return TensorNames(
        moe_prefixes=("mlp.",),
        expert_gate="gate_proj",
        expert_up="up_proj",
        expert_down="down_proj",
    )
