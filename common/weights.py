"""Weight containers shared by the router (dense part) and expert services (expert FFNs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FFNWeights:
    """A SwiGLU FFN: down(silu(gate(x)) * up(x)). Used for routed experts, shared experts and dense MLPs.

    Gate and up are one matrix, so both projections are one GEMM (one pass over x, one kernel call).
    """

    gate_up: torch.Tensor  # [2 * inter, hidden], gate rows first; plain or prepacked
    down: torch.Tensor  # [hidden, inter]

    @classmethod
    def from_parts(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> FFNWeights:
        return cls(gate_up=torch.cat([gate, up]), down=down)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v rows, one GEMM
    o: torch.Tensor  # [hidden, heads * head_dim]
    qkv_bias: torch.Tensor | None = None
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
