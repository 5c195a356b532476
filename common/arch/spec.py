"""The family-independent description of a MoE decoder, and the tensor names it is stored under."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

REQUIRED = object()

QKNorm = Literal["none", "per_head", "full"]
# How a MoE layer picks experts and weighs them (common/moe.py `route` implements each):
#   softmax        softmax over all experts in float32, top-k, optional renormalisation (Mixtral, Qwen, OLMoE)
#   sigmoid_group  sigmoid scores, group-limited top-k on scores + correction bias, weights from the
#                  uncorrected scores, optional renormalisation, times routed_scaling_factor (DeepSeek-V3, GLM-4.5)
#   topk_softmax   top-k of the (biased) logits, softmax over those k (gpt-oss)
#   softmax_pnorm  softmax in the hidden dtype, top-k, weights divided by their p-norm (DBRX)
RouterKind = Literal["softmax", "sigmoid_group", "topk_softmax", "softmax_pnorm"]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding as configured: which dims rotate, how, and the frequency scaling."""

    # dims of a head that rotate (the first ones); None: the whole head
    rotary_dim: int | None = None
    interleaved: bool = False  # pairs (x0, x1), (x2, x3)... (DeepSeek's rope_interleave) vs halves
    scaling: Literal["default", "yarn"] = "default"
    factor: float = 1.0  # yarn
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # scales cos/sin; None: derived from factor and mscale
    truncate: bool = True


@dataclass(frozen=True)
class ExpertActivation:
    """The gated activation of an expert FFN (and of dense/shared MLPs of the same family).

    silu:         down(silu(gate) * up)
    clamped_swiglu (gpt-oss): gate clamped above at `limit`, up to [-limit, limit],
                  down((up + 1) * gate * sigmoid(alpha * gate))
    """

    kind: Literal["silu", "gelu", "clamped_swiglu"] = "silu"
    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek's multi-head latent attention dimensions."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # attention variants
    qkv_bias: bool
    o_bias: bool
    qk_norm: QKNorm  # per_head: Qwen3 (over head_dim); full: OLMoE (over the whole projection)
    clip_qkv: float | None
    # MoE
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    # Mixtral multiplies expert outputs by float32 routing weights; the others cast weights to the hidden dtype first.
    combine_in_fp32: bool
    moe_layers: tuple[
        bool, ...
    ]  # False: a dense MLP layer (Qwen's mlp_only_layers / decoder_sparse_step)
    dense_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    # What the later families add; the defaults are the first four's behaviour.
    rope: RopeSpec = RopeSpec()
    norm: Literal["rms", "layer"] = "rms"  # layer: LayerNorm without bias (DBRX)
    router: RouterKind = "softmax"
    router_bias: bool = False  # gpt-oss: the gate has a bias
    n_group: int = 1  # sigmoid_group: experts fall in n_group groups; the best topk_group compete
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_pnorm: float | None = None  # softmax_pnorm: p of the weights' normalisation
    activation: ExpertActivation = ExpertActivation()
    expert_bias: bool = False  # gpt-oss: expert projections have biases
    mla: MLASpec | None = None  # DeepSeek-V3: latent attention instead of q/k/v heads
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax denominator
    sliding_window: int | None = None
    # per layer "full_attention" | "sliding_attention"; () all full
    layer_types: tuple[str, ...] = ()
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # FP8 checkpoints (quantization_config.quant_method "fp8"): e4m3 weights with a float32
    # weight_scale_inv per block of (rows, inputs) = weight_block_size; None: none
    fp8_block: tuple[int, int] | None = None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def kv_dims(self) -> tuple[int, int, int]:
        """(kv heads, key dims, value dims) of one token's cache entry per layer. MLA caches the
        normalised latent as its "key" and the rotated rope key as its "value", one head."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate and up [inter, hidden], down [hidden, inter], and
        their biases [2 * inter], [hidden] where the family has them (gpt-oss)."""
        h, i = self.hidden_size, self.expert_intermediate_size
        return 3 * h * i + (2 * i + h if self.expert_bias else 0)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, moe in enumerate(self.moe_layers) if moe]


@dataclass(frozen=True)
class TensorNames:
    """Where each weight lives. `moe_prefix(layer)` candidates are tried in order (Mixtral has two spellings)."""

    moe_prefixes: tuple[str, ...]  # relative to model.layers.{i}.
    # per-expert names relative to {moe}.experts.{e}.
    expert_gate: str
    expert_up: str
    expert_down: str

    @staticmethod
    def layer(i: int) -> str:
        return f"model.layers.{i}."


def eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def common_fields(config: dict, get) -> dict:
    """Fields every supported family spells the same way."""
    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    return dict(
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        num_layers=get("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads", heads) or heads,
        head_dim=get("head_dim", None) or hidden // heads,
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=float(
            (config.get("rope_parameters") or {}).get("rope_theta") or get("rope_theta", 10000.0)
        ),
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        top_k=get("num_experts_per_tok"),
        # transformers' attribute_map lets either spelling appear in config.json, depending on who saved it.
        num_experts=get("num_experts", None) or get("num_local_experts"),
        eos_token_ids=eos_ids(config.get("eos_token_id")),
        bos_token_id=config.get("bos_token_id"),
        torch_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        rope=rope_spec(config),
    )


def qwen_moe_layers(config: dict, get, num_layers: int) -> tuple[bool, ...]:
    """Qwen's rule: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    step = get("decoder_sparse_step", 1)
    dense = set(get("mlp_only_layers", []) or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


ROPE_TYPES = ("default", "yarn")


def yarn_mscale(factor: float, mscale: float | None = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    if factor <= 1:
        return 1.0
    return 0.1 * (mscale or 1.0) * math.log(factor) + 1.0


def rope_spec(config: dict, rotary_dim: int | None = None, interleaved: bool = False) -> RopeSpec:
    """The RoPE a config asks for: rope_parameters (transformers 5) or rope_scaling (older files).

    Raises UnsupportedModelError for a scaling type other than default and yarn."""
    from common.errors import UnsupportedModelError

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return RopeSpec(rotary_dim=rotary_dim, interleaved=interleaved)
    optional = {k: rope[k] for k in ("mscale", "mscale_all_dim", "attention_factor") if rope.get(k)}
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
    return RopeSpec(
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        scaling="yarn",
        # DeepSeek's files may leave the factor out: the ratio of the context lengths then.
        factor=float(
            factor if factor is not None else config["max_position_embeddings"] / original
        ),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
        **{k: float(v) for k, v in optional.items()},
    )
