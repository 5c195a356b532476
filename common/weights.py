"""Weight containers shared by the router (dense part) and expert services (expert FFNs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch

from common.arch.spec import ExpertActivation


@dataclass
class FFNWeights:
    """A SwiGLU FFN: down(silu(gate(x)) * up(x)). Used for routed experts, shared experts and dense MLPs.

    Gate and up are one matrix, so both projections are one GEMM (one pass over x, one kernel call);
    or, with `up` set, two views of a checkpoint that stores them apart, used as stored so that
    processes mapping the file share its pages (joining them would take a copy per process).
    """

    # [2 * inter, hidden], gate rows first; plain or prepacked. With `up`: the gate's [inter, hidden]
    gate_up: torch.Tensor
    down: torch.Tensor  # [hidden, inter]
    gate_up_bias: torch.Tensor | None = None  # [2 * inter] (gpt-oss); never with `up`
    down_bias: torch.Tensor | None = None  # [hidden]
    activation: ExpertActivation = ExpertActivation()
    # [inter, hidden], as stored (a plain view, or float32_rows.Rows): up apart from the gate
    up: torch.Tensor | None = None

    @classmethod
    def from_parts(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> FFNWeights:
        return cls(gate_up=torch.cat([gate, up]), down=down)

    @property
    def nbytes(self) -> int:
        tensors = (self.gate_up, self.up, self.down, self.gate_up_bias, self.down_bias)
        return sum(_nbytes(t) for t in tensors if t is not None)


def _nbytes(t: object) -> int:
    """A weight's bytes as held: a tensor's, or what a packed weight (common.bf16.Panels) says."""
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v rows, one GEMM
    o: torch.Tensor  # [hidden, heads * head_dim]
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim] (per_head) or [heads * head_dim] (full)
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [heads]: a learned logit in each head's softmax (gpt-oss)


@dataclass
class MLAWeights:
    """DeepSeek's multi-head latent attention (router_service/engine/mla.py): q from x directly or
    through a normalised low-rank q_lora, keys and values expanded from a normalised kv_lora latent."""

    a: torch.Tensor  # [q_out or q_lora, hidden] + [kv_lora + rope, hidden] rows: one GEMM over x
    kv_a_norm: torch.Tensor  # [kv_lora]
    kv_b: torch.Tensor  # [heads * (nope + v), kv_lora]: per head, key rows then value rows
    o: torch.Tensor  # [hidden, heads * v]
    q_b: torch.Tensor | None = None  # [heads * (nope + rope), q_lora]; None: a holds q_proj
    q_a_norm: torch.Tensor | None = None  # [q_lora]
    a_bias: torch.Tensor | None = None  # attention_bias
    o_bias: torch.Tensor | None = None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    attention: AttentionWeights | MLAWeights
    router: torch.Tensor | None = None  # [experts, hidden]; None on a dense layer
    router_bias: torch.Tensor | None = None  # [experts]: added to the logits (gpt-oss)
    router_correction: torch.Tensor | None = (
        None  # [experts]: e_score_correction_bias, for selection only
    )
    dense_mlp: FFNWeights | None = None
    shared_expert: FFNWeights | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, hidden]; None: added ungated


@dataclass
class DenseWeights:
    """Everything but the routed experts: what the router process holds."""

    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]


W = TypeVar("W")


def to_device(weights: W, device: torch.device, _moved: dict[int, torch.Tensor] | None = None) -> W:
    """`weights` (a container above, a list or dict of them) with every tensor on `device`.
    A tensor held twice (a tied LM head is the embedding) is moved once and stays shared."""
    moved = {} if _moved is None else _moved
    if isinstance(weights, torch.Tensor):
        if id(weights) not in moved:
            moved[id(weights)] = weights.to(device)
        return moved[id(weights)]  # type: ignore[return-value]
    if isinstance(weights, list):
        return [to_device(w, device, moved) for w in weights]  # type: ignore[return-value]
    if isinstance(weights, dict):
        return {k: to_device(w, device, moved) for k, w in weights.items()}  # type: ignore[return-value]
    if dataclasses.is_dataclass(weights):
        changes = {
            f.name: to_device(getattr(weights, f.name), device, moved)
            for f in dataclasses.fields(weights)
            if isinstance(getattr(weights, f.name), (torch.Tensor, list, dict))
            or dataclasses.is_dataclass(getattr(weights, f.name))
        }
        return dataclasses.replace(weights, **changes)  # type: ignore[type-var]
    return weights
