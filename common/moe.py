"""The MoE math both sides of the network share: gating, grouping tokens per expert, expert FFN, combine.

The hand-off is explicit so a network can sit in the middle:

    routing = route(x, router_weight, spec)          # router: top-k experts and weights per token
    groups = group_by_expert(routing)                # router: token rows per expert, ascending expert id
    outputs = [expert_ffn(x[g.tokens], w_e) ...]     # anywhere: colocated or on an expert service
    y = combine(groups, outputs, routing, ...)       # router: Σ w·expert(x)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_mesh.common.arch import ModelSpec
from moe_mesh.common.linear import linear
from moe_mesh.common.weights import FFNWeights


@dataclass
class Routing:
    experts: torch.Tensor  # [tokens, k] int64
    weights: torch.Tensor  # [tokens, k] float32 (Mixtral) or hidden dtype


@dataclass
class ExpertGroup:
    expert: int
    tokens: torch.Tensor  # [n] int64 row indices into the layer input
    slots: torch.Tensor  # [n] int64 flat indices into routing.weights


def route(x: torch.Tensor, router_weight: torch.Tensor, spec: ModelSpec) -> Routing:
    """Softmax over all experts in float32, top-k, optional renormalisation (always for Mixtral)."""
    logits = linear(x, router_weight)  # [tokens, experts]
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_e = torch.topk(probs, spec.top_k, dim=-1)  # [tokens, k]
    if spec.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if not spec.combine_in_fp32:
        top_w = top_w.to(x.dtype)
    return Routing(experts=top_e, weights=top_w)


def group_by_expert(
    routing: Routing, num_experts: int, counts: torch.Tensor | None = None
) -> list[ExpertGroup]:
    """Token rows per routed expert, experts ascending; each expert appears once with its whole group.

    `counts` [experts] is the bincount of routing.experts when the caller has it already."""
    k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)  # [tokens * k]
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    if counts is None:
        counts = torch.bincount(flat, minlength=num_experts)
    # Python work per routed expert only: a layer of 256 experts costs what its few routed ones do.
    routed = counts.nonzero().flatten()  # ascending
    sizes = counts[routed].tolist()
    return [
        ExpertGroup(e, tokens=t, slots=s)
        for e, t, s in zip(routed.tolist(), tokens.split(sizes), order.split(sizes))
    ]


def expert_ffn(x: torch.Tensor, w: FFNWeights) -> torch.Tensor:
    """SwiGLU expert: down(silu(gate(x)) * up(x)). x: [n, hidden] -> [n, hidden]."""
    gate, up = linear(x, w.gate_up).chunk(2, dim=-1)  # [n, inter] each
    return linear(F.silu(gate) * up, w.down)


def combine(
    groups: list[ExpertGroup],
    outputs: list[torch.Tensor],
    routing: Routing,
    num_tokens: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """Σ_k w_k · expert_k(x) per token, summed over the token's choices in routing order."""
    if not groups:
        return torch.zeros(num_tokens, like.shape[-1], dtype=like.dtype)  # [tokens, hidden]
    k = routing.experts.shape[1]
    slots = torch.cat([g.slots for g in groups])  # [tokens * k]: every (token, choice) once
    # In the routing weights' dtype (float32 for Mixtral), rounded once after the sum, as
    # transformers' default (grouped_mm) experts path computes it.
    weighted = torch.cat(outputs) * routing.weights.reshape(-1)[slots, None]
    ordered = torch.empty_like(weighted)
    ordered[slots] = weighted  # row t*k + j: token t's j-th choice
    return ordered.view(num_tokens, k, -1).sum(dim=1).to(like.dtype)  # [tokens, hidden]


def shared_expert_output(
    x: torch.Tensor, shared: FFNWeights, gate_weight: torch.Tensor
) -> torch.Tensor:
    """Qwen2-MoE's shared expert: sigmoid(gate(x)) * ffn(x)."""
    return torch.sigmoid(F.linear(x, gate_weight)) * expert_ffn(x, shared)
