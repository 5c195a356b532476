"""Qwen3-MoE: RMSNorm on q and k per head (over head_dim), no shared expert, optional dense layers."""

from __future__ import annotations

from common.arch.spec import ModelSpec, TensorNames, common_fields, qwen_moe_layers
from common.errors import UnsupportedModelError


def parse(config: dict, get) -> ModelSpec:
    if config.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true is not supported")
    fields = common_fields(config, get)
    bias = bool(get("attention_bias", False))
    return ModelSpec(
        family="qwen3_moe",
        **fields,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="per_head",
        clip_qkv=None,
        expert_intermediate_size=get("moe_intermediate_size"),
        norm_topk_prob=bool(get("norm_topk_prob", False)),
        combine_in_fp32=False,
        moe_layers=qwen_moe_layers(config, get, fields["num_layers"]),
        dense_intermediate_size=get("intermediate_size"),
        shared_expert_intermediate_size=0,
    )


def names(spec: ModelSpec) -> TensorNames:
    return TensorNames(
        moe_prefixes=("mlp.",),
        expert_gate="gate_proj",
        expert_up="up_proj",
        expert_down="down_proj",
    )
