"""MoE layers on a GPU without a host synchronisation: every layer's experts as two grouped
products, so a pass can be captured into a CUDA graph (engine/graphs.py).

The dispatcher's path groups a layer's tokens per expert in Python (group_by_expert: a
`.tolist()`, so the host waits for the GPU at every MoE layer) and calls each expert apart. Where
the router holds every expert of every layer on its GPU (a monolithic router, or one whose
placement colocates them all), a layer instead is, as SGLang's and vLLM's fused MoE on GPUs:

    route (softmax/sigmoid top-k on the device) -> sort the (token, choice) rows by expert ->
    one grouped product over [experts, 2I, H] (torch._grouped_mm, group ends on the device) ->
    the gated activation -> one grouped product over [experts, H, I] -> each row weighted and
    put back at its (token, choice) place -> summed over the choices.

The sum runs over a token's choices in routing order, in the routing weights' dtype, as
common.moe.combine does, so no atomic adds make it depend on the run. Each layer's choices are
returned on the device and read once a step (engine/gpu.py), for utilization.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from common.arch import ModelSpec
from common.arch.spec import ExpertActivation
from common.moe import gated, route, shared_expert_output
from common.weights import FFNWeights, LayerWeights


@dataclass
class StackedExperts:
    """One layer's experts in one tensor per projection, expert-major."""

    gate_up: torch.Tensor  # [experts, 2I, H], gate rows first
    down: torch.Tensor  # [experts, H, I]
    gate_up_bias: torch.Tensor | None  # [experts, 2I]
    down_bias: torch.Tensor | None  # [experts, H]
    activation: ExpertActivation


@functools.cache
def grouped_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped product runs here for `dtype`, empty groups included, with the
    values of one product per group, and on a GPU without reading the group ends back: torch
    runs it on the device for bfloat16 on Hopper and Blackwell (compute capability 9 and 10);
    elsewhere its fallback copies the ends to the host, which a CUDA graph cannot capture."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda" and (
        dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] not in (9, 10)
    ):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=gen).to(device, dtype)
    w = torch.randn(3, 16, 32, generator=gen).to(device, dtype)
    offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)
    try:
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    want = torch.cat([x[:8] @ w[0].T, x[8:] @ w[2].T])
    return bool(torch.allclose(y.float(), want.float(), rtol=2e-2, atol=2e-2))


def stack(
    experts: Mapping[tuple[int, int], FFNWeights],
    spec: ModelSpec,
    previous: Mapping[int, StackedExperts] | None = None,
) -> dict[int, StackedExperts] | None:
    """Every MoE layer's experts stacked, the mapping's weights then made views of the stacks
    (so the GPU holds them once); None where some expert is missing or held apart (quantized).
    A layer whose experts are still the views of its `previous` stack (a re-tiering kept them)
    keeps that stack: stacking it again would hold both while the new one is made."""
    pairs = [(layer, e) for layer in spec.moe_layer_ids for e in range(spec.num_experts)]
    if any(not isinstance(getattr(experts.get(p), "down", None), torch.Tensor) for p in pairs):
        return None
    stacks: dict[int, StackedExperts] = {}
    for layer in spec.moe_layer_ids:  # a layer at a time: its originals go as its stack comes
        ws = [experts[(layer, e)] for e in range(spec.num_experts)]
        kept = (previous or {}).get(layer)
        if kept is not None and all(_views_of(kept, e, w) for e, w in enumerate(ws)):
            stacks[layer] = kept
            continue
        s = stacks[layer] = _stacked(ws)
        for e in range(spec.num_experts):
            experts[(layer, e)] = FFNWeights(  # type: ignore[index]
                gate_up=s.gate_up[e],
                down=s.down[e],
                gate_up_bias=None if s.gate_up_bias is None else s.gate_up_bias[e],
                down_bias=None if s.down_bias is None else s.down_bias[e],
                activation=s.activation,
            )
    return stacks


def _views_of(s: StackedExperts, e: int, w: FFNWeights) -> bool:
    """Whether expert `e`'s weights `w` are the views `stack` made of `s`."""
    return (
        w.up is None
        and w.gate_up.data_ptr() == s.gate_up[e].data_ptr()
        and w.down.data_ptr() == s.down[e].data_ptr()
    )


def _stacked(ws: list[FFNWeights]) -> StackedExperts:
    def joined(w: FFNWeights) -> torch.Tensor:
        return w.gate_up if w.up is None else torch.cat([w.gate_up, w.up])

    def biases(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if ts[0] is None else torch.stack(ts)  # type: ignore[arg-type]

    return StackedExperts(
        gate_up=torch.stack([joined(w) for w in ws]),
        down=torch.stack([w.down for w in ws]),
        gate_up_bias=biases([w.gate_up_bias for w in ws]),
        down_bias=biases([w.down_bias for w in ws]),
        activation=ws[0].activation,
    )


def moe_layer(
    x: torch.Tensor,
    w: LayerWeights,
    experts: StackedExperts,
    spec: ModelSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, hidden] (normed) -> routed (+ shared) expert output [tokens, hidden], and the
    experts each token chose [tokens, k]. No host synchronisation."""
    routing = route(x, w.router, spec, w.router_bias, w.router_correction)
    tokens, k = routing.experts.shape
    flat = routing.experts.reshape(-1)  # [tokens * k]: row t*k + j is token t's j-th choice
    order = torch.argsort(flat, stable=True)  # the rows by expert
    which = flat[order]
    sizes = torch.zeros(spec.num_experts, dtype=torch.int32, device=x.device)
    sizes.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = sizes.cumsum(0, dtype=torch.int32)  # each group's end: known on the device only
    rows = x[order // k]  # [tokens * k, hidden]
    h = torch._grouped_mm(rows, experts.gate_up.transpose(1, 2), offs=ends)  # [rows, 2I]
    if experts.gate_up_bias is not None:
        h = h + experts.gate_up_bias[which]
    gate, up = h.chunk(2, dim=-1)
    a = gated(gate, up, experts.activation).contiguous()
    y = torch._grouped_mm(a, experts.down.transpose(1, 2), offs=ends)  # [rows, hidden]
    if experts.down_bias is not None:
        y = y + experts.down_bias[which]
    weights = routing.weights.reshape(-1)
    placed = torch.empty_like(y, dtype=weights.dtype)
    placed[order] = y.to(weights.dtype) * weights[order, None]  # back at (token, choice)
    choices = placed.view(tokens, k, -1)
    if routing.add_in_order:  # DBRX: added one by one in the hidden dtype, as combine does
        out = choices[:, 0]
        for j in range(1, k):
            out = out + choices[:, j]
        out = out.to(x.dtype)
    else:
        out = choices.sum(dim=1).to(x.dtype)
    if w.shared_expert is not None:
        out = out + shared_expert_output(x, w.shared_expert, w.shared_expert_gate)
    return out, routing.experts
