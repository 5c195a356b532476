"""The MoE math both sides of the network share: gating, grouping tokens per expert, expert FFN, combine.

The hand-off is explicit so a network can sit in the middle:

    routing = route(x, router_weight, spec)          # router: top-k experts and weights per token
    groups = group_by_expert(routing)                # router: token rows per expert, ascending expert id
    outputs = experts_ffn([(x[g.tokens], w_e) ...])  # anywhere: colocated or on an expert service
    y = combine(groups, outputs, routing, ...)       # router: Σ w·expert(x)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import bf16, float32_ffns
from common.arch import ModelSpec
from common.arch.spec import ExpertActivation
from common.linear import linear
from common.weights import FFNWeights


@dataclass
class Routing:
    experts: torch.Tensor  # [tokens, k] int64
    weights: torch.Tensor  # [tokens, k] float32 (Mixtral) or hidden dtype
    # DBRX: transformers adds each weighted output into the running sum in the hidden dtype,
    # experts ascending; combine then does the same (the experts come sorted).
    add_in_order: bool = False


@dataclass
class ExpertGroup:
    expert: int
    # [n] int64 row indices into the layer input, or slice(None) when the layer has one token
    tokens: torch.Tensor | slice
    # [n] int64 flat indices into routing.weights; with one token, its choice's index
    slots: torch.Tensor | int

    @property
    def size(self) -> int:
        """Token rows in the group."""
        return 1 if isinstance(self.slots, int) else len(self.slots)


def route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    spec: ModelSpec,
    bias: torch.Tensor | None = None,
    correction: torch.Tensor | None = None,
) -> Routing:
    """Top-k experts and their weights per token, by the family's rule (spec.router)."""
    if spec.router == "sigmoid_group":
        return _route_sigmoid_group(x, router_weight, spec, correction)
    if spec.router == "softmax" and bias is None:  # bfloat16: one call, the fused step's bits
        fused = bf16.route(
            x, router_weight, spec.top_k, spec.norm_topk_prob, not spec.combine_in_fp32
        )
        if fused is not None:
            return Routing(experts=fused[0], weights=fused[1])
    logits = linear(x, router_weight, bias)  # [tokens, experts]
    if spec.router == "topk_softmax":  # gpt-oss: softmax over the k best logits only
        top_logits, top_e = torch.topk(logits, spec.top_k, dim=-1)
        return Routing(experts=top_e, weights=torch.softmax(top_logits, dim=1))
    if spec.router == "softmax_pnorm":  # DBRX: in the hidden dtype, weights over their p-norm
        top_w, top_e = torch.topk(torch.softmax(logits, dim=1), spec.top_k, dim=-1)
        if spec.router_pnorm is not None:
            top_w = top_w / torch.norm(top_w, p=spec.router_pnorm, dim=-1, keepdim=True)
        top_e, order = top_e.sort(dim=-1)
        return Routing(experts=top_e, weights=top_w.gather(1, order), add_in_order=True)
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_e = torch.topk(probs, spec.top_k, dim=-1)  # [tokens, k]
    if spec.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if not spec.combine_in_fp32:
        top_w = top_w.to(x.dtype)
    return Routing(experts=top_e, weights=top_w)


def _route_sigmoid_group(
    x: torch.Tensor, weight: torch.Tensor, spec: ModelSpec, correction: torch.Tensor | None
) -> Routing:
    """DeepSeek-V3 / GLM-4.5, in float32: sigmoid scores; the correction bias steers which experts
    are chosen (best topk_group of n_group groups, a group ranked by its two best experts) but not
    their weights, which are the plain scores, optionally renormalised, times routed_scaling_factor."""
    scores = torch.sigmoid(F.linear(x.float(), weight.float()))  # [tokens, experts]
    choice = scores if correction is None else scores + correction
    groups = choice.view(-1, spec.n_group, spec.num_experts // spec.n_group)
    group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)  # [tokens, n_group]
    best = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
    top_e = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    top_w = scores.gather(1, top_e)
    if spec.norm_topk_prob:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(experts=top_e, weights=top_w * spec.routed_scaling_factor)


def group_by_expert(routing: Routing, num_experts: int) -> list[ExpertGroup]:
    """Token rows per routed expert, experts ascending; each expert appears once with its whole group.

    A single token (decode at batch 1) is grouped in Python: index tensors would cost more torch
    calls than the experts' products, each tens of microseconds once the weights streamed through
    the caches."""
    k = routing.experts.shape[1]
    if routing.experts.shape[0] == 1:
        chosen = routing.experts[0].tolist()  # k distinct experts
        order = sorted(range(k), key=chosen.__getitem__)
        return [ExpertGroup(chosen[j], tokens=slice(None), slots=j) for j in order]
    if (grouped := bf16.group(routing.experts, num_experts)) is not None:
        order, tokens, counts = grouped
        routed = [e for e, c in enumerate(counts) if c]
        sizes = [counts[e] for e in routed]
    else:
        flat = routing.experts.reshape(-1)  # [tokens * k]
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=num_experts)
        # Python work per routed expert only: 256 experts cost what their few routed ones do.
        nonzero = counts.nonzero().flatten()  # ascending
        routed, sizes = nonzero.tolist(), counts[nonzero].tolist()
    # Views of one tensor each: gather_rows joins the tokens back without a copy.
    return [
        ExpertGroup(e, tokens=t, slots=s)
        for e, t, s in zip(routed, tokens.split(sizes), order.split(sizes))
    ]


def gather_rows(x: torch.Tensor, groups: list[ExpertGroup]) -> list[torch.Tensor]:
    """Each group's rows of x, as views of one gathered tensor: one index op for the layer, not
    one per group, and groups next to each other (one service's experts) are next to each other
    in memory, so `joined` sends them without another copy."""
    if not groups or isinstance(groups[0].tokens, slice):  # one token: every group is x itself
        return [x[g.tokens] for g in groups]
    rows = x.index_select(0, joined([g.tokens for g in groups]))
    return list(rows.split([g.size for g in groups]))


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `parts` as one tensor: a view when they lie back to back in one buffer (as
    gather_rows leaves consecutive groups), else a copy."""
    first = parts[0]
    if len(parts) == 1:
        return first
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for p in parts:
        if (
            p.data_ptr() != end
            or not p.is_contiguous()
            or p.dtype != first.dtype
            or p.untyped_storage().data_ptr() != storage
        ):
            return torch.cat(parts)
        end += p.numel() * p.element_size()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def expert_ffn(x: torch.Tensor, w: FFNWeights) -> torch.Tensor:
    """A gated expert: down(act(gate(x), up(x))). x: [n, hidden] -> [n, hidden].

    Biases (gpt-oss) are added to the rounded products, as transformers adds them: a bias fused
    into the GEMM rounds once, and differs from it in the last bit of most bfloat16 outputs."""
    if w.up is not None:  # gate and up apart, as the checkpoint stores them (FFNWeights)
        gate, up = linear(x, w.gate_up), linear(x, w.up)  # [n, inter] each
        y = linear(gated(gate, up, w.activation), w.down)  # [n, hidden]
        return y if w.down_bias is None else y + w.down_bias
    if plain_silu(w):
        if (y := bf16.silu_ffn(x, w.gate_up, w.down)) is not None:  # one call, bfloat16 panels
            return y
    h = linear(x, w.gate_up)  # [n, 2 * inter]
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias
    gate, up = h.chunk(2, dim=-1)  # [n, inter] each
    y = linear(gated(gate, up, w.activation), w.down)  # [n, hidden]
    return y if w.down_bias is None else y + w.down_bias


def experts_ffn(batches: Sequence[tuple[torch.Tensor, FFNWeights]]) -> list[torch.Tensor]:
    """expert_ffn(x, w) for each (x, w) of one layer: in one kernel call where every expert is a
    plain SiLU FFN in bfloat16 panels (bf16.silu_ffns: the threads share all the experts' work,
    as SGLang's fused_experts does); plain float32 ones of a few rows likewise
    (float32_ffns.silu_ffns); the rest one call each. The same bits either way."""
    if all(fusable(w) for _, w in batches):
        fused = bf16.silu_ffns([(x, w.gate_up, w.down) for x, w in batches])
        if fused is not None:
            return fused
    outs = float32_ffns.silu_ffns(
        [(x, w.gate_up, w.up, w.down) if plain_silu(w) else None for x, w in batches],
        lambda i: expert_ffn(*batches[i]),
    )
    return [expert_ffn(x, w) if y is None else y for y, (x, w) in zip(outs, batches)]


def fusable(w: FFNWeights) -> bool:
    """Whether experts_ffn computes `w` together with its layer's other experts."""
    return w.up is None and plain_silu(w) and isinstance(w.gate_up, bf16.Panels)


def plain_silu(w: FFNWeights) -> bool:
    """A SiLU-gated FFN without biases (what the one-call kernels take)."""
    return w.activation.kind == "silu" and w.gate_up_bias is None and w.down_bias is None


def gated(gate: torch.Tensor, up: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """The gated activation between an FFN's two projections (spec.ExpertActivation)."""
    if act.kind == "silu":
        return F.silu(gate) * up
    if act.kind == "gelu":
        return F.gelu(gate) * up
    gate = gate.clamp(max=act.limit)  # clamped_swiglu (gpt-oss)
    up = up.clamp(-act.limit, act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def combine(
    groups: list[ExpertGroup],
    outputs: list[torch.Tensor],
    routing: Routing,
    num_tokens: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """Σ_k w_k · expert_k(x) per token, summed over the token's choices in routing order."""
    if not groups:
        return torch.zeros(num_tokens, like.shape[-1], dtype=like.dtype, device=like.device)
    k = routing.experts.shape[1]
    if not routing.add_in_order:  # the torch ops below, in one call
        slots = [g.slots for g in groups]
        if (
            y := bf16.combine(outputs, slots, routing.weights.reshape(-1), k, like.dtype)
        ) is not None:
            return y
    # In the routing weights' dtype (float32 for Mixtral), rounded once after the sum, as
    # transformers' default (grouped_mm) experts path computes it.
    if isinstance(groups[0].slots, int):  # one token (group_by_expert): its choices in order
        by_choice = [outputs[i] for i in sorted(range(len(groups)), key=lambda i: groups[i].slots)]
        ordered = torch.cat(by_choice) * routing.weights.reshape(-1, 1)
    else:
        slots = torch.cat([g.slots for g in groups])  # [tokens * k]: every (token, choice) once
        weighted = torch.cat(outputs) * routing.weights.reshape(-1)[slots, None]
        ordered = torch.empty_like(weighted)
        ordered[slots] = weighted  # row t*k + j: token t's j-th choice
    choices = ordered.view(num_tokens, k, -1)  # [tokens, k, hidden]
    if routing.add_in_order:
        y = choices[:, 0]
        for j in range(1, k):
            y = y + choices[:, j]
        return y.to(like.dtype)
    return choices.sum(dim=1).to(like.dtype)  # [tokens, hidden]


def shared_expert_output(
    x: torch.Tensor, shared: FFNWeights, gate_weight: torch.Tensor | None
) -> torch.Tensor:
    """The shared expert: gated by sigmoid(gate(x)) in Qwen2-MoE, added as it is elsewhere."""
    if gate_weight is None:
        return expert_ffn(x, shared)
    return torch.sigmoid(F.linear(x, gate_weight)) * expert_ffn(x, shared)
