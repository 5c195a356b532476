"""Weight containers shared by the router (dense part) and expert services (expert FFNs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FFNWeights:
    """A SwiGLU FFN: down(silu(gate(x)) * up(x)). Used for routed experts, shared experts and dense MLPs."""

    gate: torch.Tensor  # [inter, hidden]
    up: torch.Tensor  # [inter, hidden]
    down: torch.Tensor  # [hidden, inter]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))


@dataclass
class AttentionWeights:
    q: torch.Tensor  # [heads * head_dim, hidden]
    k: torch.Tensor  # [kv_heads * head_dim, hidden]
    v: torch.Tensor  # [kv_heads * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim] (per_head) or [heads * head_dim] (full)
    k_norm: torch.Tensor | None = None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    attention: AttentionWeights
    router: torch.Tensor | None = None  # [experts, hidden]; None on a dense layer
    dense_mlp: FFNWeights | None = None
    shared_expert: FFNWeights | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, hidden]


@dataclass
class DenseWeights:
    """Everything but the routed experts: what the router process holds."""

    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
