"""gpt-oss: attention sinks, sliding-window layers, q/k/v/o biases, a biased router with a softmax
over the top-k logits, experts with biases and a clamped SwiGLU, stored fused (gate and up
interleaved) in float or in MXFP4 (docs/families/gpt_oss.md)."""

from __future__ import annotations

import torch

from common import mxfp4
from common.arch.spec import ExpertActivation, ModelSpec, TensorNames, common_fields
from common.errors import CheckpointError
from common.quant import QuantPanels
from common.weights import FFNWeights, LayerWeights

LAYER_TYPES = ("sliding_attention", "full_attention")


def parse(config: dict, get) -> ModelSpec:
    fields = common_fields(config, get)
    n = fields["num_layers"]
    # transformers' default when the file has none: even layers slide, odd ones see everything.
    layer_types = tuple(get("layer_types", None) or (LAYER_TYPES[i % 2] for i in range(n)))
    if len(layer_types) != n or not set(layer_types) <= set(LAYER_TYPES):
        raise CheckpointError(
            f"layer_types must list {n} of {', '.join(LAYER_TYPES)}; got {list(layer_types)}"
        )
    window = config.get("sliding_window")
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        raise CheckpointError(f"sliding_window={window!r}: sliding layers need a positive integer")
    bias = bool(get("attention_bias", True))
    return ModelSpec(
        family="gpt_oss",
        **fields,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="none",
        clip_qkv=None,
        expert_intermediate_size=get("intermediate_size"),
        norm_topk_prob=False,
        combine_in_fp32=False,
        moe_layers=(True,) * n,
        dense_intermediate_size=0,
        shared_expert_intermediate_size=0,
        router="topk_softmax",
        router_bias=True,
        activation=ExpertActivation(
            "clamped_swiglu", float(get("swiglu_alpha", 1.702)), float(get("swiglu_limit", 7.0))
        ),
        expert_bias=True,
        attention_sinks=True,
        sliding_window=window,
        layer_types=layer_types,
    )


def names(spec: ModelSpec) -> TensorNames:
    # Experts are fused tensors that load_expert reads; the per-expert names are never used.
    return TensorNames(
        moe_prefixes=("mlp.",),
        expert_gate="gate_up_proj",
        expert_up="gate_up_proj",
        expert_down="down_proj",
    )


def load_layer(checkpoint, i: int) -> LayerWeights:
    s, p = checkpoint.spec, f"model.layers.{i}."
    h, e = s.hidden_size, s.num_experts
    attention = checkpoint.attention(p + "self_attn.")
    attention.sinks = checkpoint.tensor(p + "self_attn.sinks", (s.num_heads,))
    return LayerWeights(
        input_norm=checkpoint.tensor(p + "input_layernorm.weight", (h,)),
        post_attention_norm=checkpoint.tensor(p + "post_attention_layernorm.weight", (h,)),
        attention=attention,
        router=checkpoint.tensor(p + "mlp.router.weight", (e, h)),
        router_bias=checkpoint.tensor(p + "mlp.router.bias", (e,)),
    )


def load_expert(checkpoint, layer: int, expert: int) -> FFNWeights:
    """One expert of the fused tensors, float ([E, H, 2I] and [E, I, H], as transformers stores
    them) or MXFP4 (*_blocks / *_scales, rows as [E, 2I, H] and [E, H, I]). Gate and up columns
    alternate there; ours are gate rows first, so they are de-interleaved here, biases alike."""
    s = checkpoint.spec
    e, h, i = s.num_experts, s.hidden_size, s.expert_intermediate_size
    base = f"model.layers.{layer}.mlp.experts."
    gate_up_bias = checkpoint.tensor(base + "gate_up_proj_bias", (e, 2 * i))[expert]
    down_bias = checkpoint.tensor(base + "down_proj_bias", (e, h))[expert]
    if checkpoint.has(base + "gate_up_proj_blocks") or checkpoint.has(base + "gate_up_proj_scales"):
        gate_up, down = _mxfp4(checkpoint, base, expert, down_bias.dtype)
    else:
        gate_up = _gate_first(checkpoint.tensor(base + "gate_up_proj", (e, h, 2 * i))[expert].T)
        down = checkpoint.tensor(base + "down_proj", (e, i, h))[expert].T.contiguous()  # [H, I]
    return FFNWeights(
        gate_up=_held(checkpoint, gate_up),
        down=_held(checkpoint, down),
        gate_up_bias=_gate_first(gate_up_bias),
        down_bias=down_bias,
        activation=s.activation,
    )


def _gate_first(t: torch.Tensor) -> torch.Tensor:
    """Rows g0, u0, g1, u1, ... -> g0, g1, ..., u0, u1, ... (a copy)."""
    return torch.cat([t[0::2], t[1::2]])


def _held(checkpoint, weight):
    """A weight as the checkpoint holds it for serving (MXFP4 panels are held already)."""
    return weight if isinstance(weight, QuantPanels) else checkpoint.pack(weight)


def _mxfp4(checkpoint, base: str, expert: int, dtype) -> tuple:
    """Expert `expert`'s gate_up (gate rows first) and down from the MXFP4 pairs *_blocks /
    *_scales under `base`: computed from their codes where the kernels can take both (packed once
    a host into one cache entry, as other formats' experts are: a file an expert), else
    dequantized."""
    s = checkpoint.spec
    raw, shapes = {}, {"gate_up": (2 * s.expert_intermediate_size, s.hidden_size)}
    shapes["down"] = (s.hidden_size, s.expert_intermediate_size)
    for w, (rows, cols) in shapes.items():
        name = f"{base}{w}_proj"
        if cols % mxfp4.BLOCK:
            raise CheckpointError(
                f"MXFP4 needs rows of a multiple of {mxfp4.BLOCK} weights; the config implies "
                f"{cols}",
                file=str(checkpoint.path),
                tensor=name + "_blocks",
            )
        e, groups = s.num_experts, cols // mxfp4.BLOCK
        raw[w] = (
            checkpoint.tensor(name + "_blocks", (e, rows, groups, 16), dtype=torch.uint8)[expert],
            checkpoint.tensor(name + "_scales", (e, rows, groups), dtype=torch.uint8)[expert],
        )
    order = {"gate_up": _gate_first, "down": lambda rows: rows}
    if not (checkpoint.prepacked and all(mxfp4.computable(dtype, r) for r, _ in shapes.values())):
        return tuple(mxfp4.dequantize(*map(order[w], raw[w]), dtype) for w in shapes)

    def fill(out: dict[str, torch.Tensor]) -> None:
        for w, (blocks, scales) in raw.items():
            tensor = f"{base}{w}_proj_scales"
            data, packed_scales = out[f"{w}.data"], out[f"{w}.scales"]
            mxfp4.pack(order[w](blocks), order[w](scales), tensor, data, packed_scales)
            checkpoint.release(blocks, scales)  # their file pages, copied into the panels

    sizes = {
        f"{w}.{part}": size
        for w, x in shapes.items()
        for part, size in mxfp4.FORMAT.layout(x).items()
    }
    held = checkpoint.packed_entry(f"{base.removeprefix('model.')}{expert}-mxfp4", sizes, fill)
    return tuple(
        QuantPanels.of(held[f"{w}.data"], held[f"{w}.scales"], x, mxfp4.FORMAT)
        for w, x in shapes.items()
    )
