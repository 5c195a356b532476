"""Mixtral: top-k weights always renormalised; experts w1 (gate), w3 (up), w2 (down) under block_sparse_moe."""

from __future__ import annotations

from common.arch.spec import ModelSpec, TensorNames, common_fields
from common.errors import UnsupportedModelError


def parse(config: dict, get) -> ModelSpec:
    if config.get("sliding_window") is not None:
        raise UnsupportedModelError(
            f"sliding_window={config['sliding_window']} is not supported; set it to null"
        )
    fields = common_fields(config, get)
    return ModelSpec(
        family="mixtral",
        **fields,
        qkv_bias=False,
        o_bias=False,
        qk_norm="none",
        clip_qkv=None,
        expert_intermediate_size=get("intermediate_size"),
        norm_topk_prob=True,
        combine_in_fp32=True,
        moe_layers=(True,) * fields["num_layers"],
        dense_intermediate_size=0,
        shared_expert_intermediate_size=0,
    )


def names(spec: ModelSpec) -> TensorNames:
    # Published checkpoints use block_sparse_moe; transformers v5's native (fused) layout uses mlp.
    return TensorNames(
        moe_prefixes=("block_sparse_moe.", "mlp."),
        expert_gate="w1",
        expert_up="w3",
        expert_down="w2",
    )
