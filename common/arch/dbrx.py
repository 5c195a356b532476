"""DBRX: nested attn_config / ffn_config, a fused Wqkv clamped to ±clip_qkv, LayerNorm without bias,
softmax routing in the hidden dtype with the top-k weights divided by their p-norm, and every
layer's experts stored as three [experts * inter, hidden] matrices (w1 gate, v1 up, w2 down
transposed: transformers applies it as `h @ w2[e]`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.arch.spec import (
    REQUIRED,
    ExpertActivation,
    ModelSpec,
    TensorNames,
    eos_ids,
    rope_spec,
)
from common.errors import CheckpointError, UnsupportedModelError
from common.weights import AttentionWeights, FFNWeights, LayerWeights

if TYPE_CHECKING:
    from common.checkpoint import Checkpoint

DENSE_NAMES = ("transformer.wte.weight", "transformer.norm_f.weight")
# nn.LayerNorm's default: DBRX's config has no epsilon field.
LAYER_NORM_EPS = 1e-5
ACTIVATIONS = ("silu", "gelu")  # ffn_config.ffn_act_fn names transformers maps to these


def parse(config: dict, get) -> ModelSpec:
    attn, ffn = get("attn_config"), get("ffn_config")

    def sub(section: str, values: dict, key: str, default=REQUIRED):
        value = values.get(key, default)
        if value is REQUIRED or (value is None and default is REQUIRED):
            raise CheckpointError(f"missing config field '{section}.{key}'")
        return value

    hidden, heads = get("d_model"), get("n_heads")
    if hidden % heads:
        raise CheckpointError(f"d_model={hidden} is not a multiple of n_heads={heads}")
    if get("tie_word_embeddings", False):  # transformers' DbrxConfig refuses it too
        raise UnsupportedModelError("tie_word_embeddings=true is not supported by DBRX")
    act = (sub("ffn_config", ffn, "ffn_act_fn", None) or {}).get("name", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"ffn_config.ffn_act_fn name={act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )
    experts, top_k = sub("ffn_config", ffn, "moe_num_experts"), sub("ffn_config", ffn, "moe_top_k")
    if top_k > experts:
        raise CheckpointError(f"ffn_config.moe_top_k={top_k} exceeds the {experts} experts")
    # transformers 5 reads rope_parameters; files written before it (the published ones) keep
    # the base in attn_config, which transformers 5.23 ignores (it falls back to 10000).
    theta = (config.get("rope_parameters") or {}).get("rope_theta") or attn.get("rope_theta")
    pnorm = ffn.get("moe_normalize_expert_weights", 1.0)  # null: weights left unnormalised
    clip = attn.get("clip_qkv")
    num_layers = get("n_layers")
    return ModelSpec(
        family="dbrx",
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=sub("attn_config", attn, "kv_n_heads"),
        head_dim=hidden // heads,
        rms_norm_eps=LAYER_NORM_EPS,
        rope_theta=float(theta or 10000.0),
        max_position_embeddings=get("max_seq_len"),
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        qk_norm="none",
        clip_qkv=float(clip) if clip is not None else None,
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=sub("ffn_config", ffn, "ffn_hidden_size"),
        norm_topk_prob=False,  # the p-norm (router_pnorm) takes its place
        combine_in_fp32=False,
        moe_layers=(True,) * num_layers,
        dense_intermediate_size=0,
        shared_expert_intermediate_size=0,
        eos_token_ids=eos_ids(config.get("eos_token_id")),
        bos_token_id=config.get("bos_token_id"),
        torch_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        rope=rope_spec({**config, "max_position_embeddings": config.get("max_seq_len")}),
        norm="layer",
        router="softmax_pnorm",
        router_pnorm=float(pnorm) if pnorm is not None else None,
        activation=ExpertActivation(kind=act),
    )


def names(spec: ModelSpec) -> TensorNames:
    # Only for code that asks: loading goes through load_layer / load_expert below.
    return TensorNames(moe_prefixes=("ffn.",), expert_gate="w1", expert_up="v1", expert_down="w2")


def load_layer(ckpt: Checkpoint, i: int) -> LayerWeights:
    """Norms, attention and router of block i (transformer.blocks.{i}.)."""
    s, p = ckpt.spec, f"transformer.blocks.{i}."
    h, hd = s.hidden_size, s.head_dim
    qkv_rows = (s.num_heads + 2 * s.num_kv_heads) * hd
    a = p + "norm_attn_norm."
    return LayerWeights(
        input_norm=ckpt.tensor(a + "norm_1.weight", (h,)),
        post_attention_norm=ckpt.tensor(a + "norm_2.weight", (h,)),
        attention=AttentionWeights(
            qkv=ckpt.pack(ckpt.tensor(a + "attn.Wqkv.weight", (qkv_rows, h))),  # q, k, v rows
            o=ckpt.pack(ckpt.tensor(a + "attn.out_proj.weight", (h, s.num_heads * hd))),
        ),
        router=ckpt.tensor(p + "ffn.router.layer.weight", (s.num_experts, h)),
    )


def load_expert(ckpt: Checkpoint, layer: int, expert: int) -> FFNWeights:
    """Expert `expert`'s rows of the layer's w1, v1, w2 (only these pages of the files are read)."""
    s = ckpt.spec
    e, i, h = s.num_experts, s.expert_intermediate_size, s.hidden_size
    base, rows = f"transformer.blocks.{layer}.ffn.experts.mlp.", slice(expert * i, (expert + 1) * i)
    gate, up, down_t = (ckpt.tensor(base + n, (e * i, h), rows) for n in ("w1", "v1", "w2"))
    return FFNWeights(
        gate_up=ckpt.pack(torch.cat([gate, up])),  # [2I, H]
        down=ckpt.pack(down_t.T),  # [H, I]: w2's rows are down's columns
        activation=s.activation,
    )
