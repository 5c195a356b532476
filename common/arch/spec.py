"""The family-independent description of a MoE decoder, and the tensor names it is stored under."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

REQUIRED = object()

QKNorm = Literal["none", "per_head", "full"]


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

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate and up [inter, hidden], down [hidden, inter]."""
        return 3 * self.hidden_size * self.expert_intermediate_size

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
    )


def qwen_moe_layers(config: dict, get, num_layers: int) -> tuple[bool, ...]:
    """Qwen's rule: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    step = get("decoder_sparse_step", 1)
    dense = set(get("mlp_only_layers", []) or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
