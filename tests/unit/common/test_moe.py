"""common/moe.py: a lone token is grouped and combined without index tensors, to the same bits as
the same token in a batch; a layer's rows are gathered once and a service's groups sent as one view;
gating picks the experts and weights of transformers' own router, for each family."""

from __future__ import annotations

import pytest
import torch

from common import bf16
from common.arch import FAMILIES, parse_spec
from common.moe import (
    Routing,
    combine,
    expert_ffn,
    experts_ffn,
    gather_rows,
    group_by_expert,
    joined,
    route,
)
from common.weights import FFNWeights
from tests.support.hf import moe_blocks


def outputs_of(x: torch.Tensor, groups) -> list[torch.Tensor]:
    """Stand-in expert outputs: a different function of the rows per expert."""
    return [torch.sin(x[g.tokens] * (g.expert + 1)) for g in groups]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("add_in_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_token_combines_to_the_bits_it_gets_in_a_batch(k, add_in_order, dtype) -> None:
    gen = torch.Generator().manual_seed(k)
    tokens, experts, hidden = 5, 8, 64
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)  # float32, as Mixtral combines
    batch = Routing(chosen, weights, add_in_order)
    groups = group_by_expert(batch, experts)
    together = combine(groups, outputs_of(x, groups), batch, tokens, like=x)
    for t in range(tokens):
        alone = Routing(chosen[t : t + 1], weights[t : t + 1], add_in_order)
        lone_groups = group_by_expert(alone, experts)
        assert [g.expert for g in lone_groups] == sorted(chosen[t].tolist())
        assert [g.size for g in lone_groups] == [1] * k
        got = combine(lone_groups, outputs_of(x[t : t + 1], lone_groups), alone, 1, like=x)
        assert torch.equal(got, together[t : t + 1])


def test_rows_are_gathered_once_and_consecutive_groups_join_without_a_copy() -> None:
    x = torch.randn(6, 8)
    experts = torch.tensor([[3, 1], [0, 3], [1, 2], [3, 0], [2, 1], [0, 2]])
    groups = group_by_expert(Routing(experts, torch.rand(6, 2)), 4)
    rows = gather_rows(x, groups)
    assert [r.tolist() for r in rows] == [x[g.tokens].tolist() for g in groups]
    both = joined(rows[1:3])  # what a service holding experts 1 and 2 is sent
    assert both.data_ptr() == rows[1].data_ptr()  # a view: no copy
    assert torch.equal(both, torch.cat(rows[1:3]))
    # Not back to back (another group between, or separate tensors): copied, same rows.
    for parts in (rows[1:4:2], [x[:2], x[2:3].clone()]):
        out = joined(parts)
        assert torch.equal(out, torch.cat(parts)) and out.data_ptr() != parts[0].data_ptr()
    lone = group_by_expert(Routing(torch.tensor([[2, 0]]), torch.rand(1, 2)), 4)
    assert all(r is not None and torch.equal(r, x[:1]) for r in gather_rows(x[:1], lone))


# -- gating against transformers' own routers ------------------------------------------------------

# Families whose config says whether the top-k weights are renormalised get both settings.
RENORMALISABLE = ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe")
GATINGS = [(arch, None) for arch in FAMILIES if arch not in RENORMALISABLE] + [
    (arch, norm) for arch in RENORMALISABLE for norm in (False, True)
]


def hf_tiny(arch: str, norm_topk_prob: bool | None) -> torch.nn.Module:
    """transformers' tiny model of a family, as `checkpoint create` builds it (no file written)."""
    import transformers

    from moe_mesh.dev.families import CLASSES, PRESET_SIZES, config_kwargs, init_parameters

    config_class, model_class = (getattr(transformers, name) for name in CLASSES[arch])
    kwargs = config_kwargs(arch, PRESET_SIZES["tiny"], PRESET_SIZES["tiny"]["vocab"])
    if norm_topk_prob is not None:
        kwargs["norm_topk_prob"] = norm_topk_prob
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).eval()
    init_parameters(model, seed=0)  # the correction bias and gpt-oss' router bias are not zero
    return model


def hf_routing(block: torch.nn.Module, router: torch.nn.Module, x: torch.Tensor) -> Routing:
    """The experts and weights transformers' MoE block gives each token of `x`."""
    if hasattr(block, "route_tokens_to_experts"):  # DBRX: the router gives logits only
        weights, experts = block.route_tokens_to_experts(router(x))
    else:
        _, weights, experts = router(x)
    return Routing(experts, weights)


def by_expert(r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's choices in ascending expert order (the two sides may list them differently)."""
    experts, order = r.experts.sort(dim=-1)
    return experts, r.weights.gather(1, order)


@pytest.mark.parametrize(("arch", "norm_topk_prob"), GATINGS)
def test_gating_chooses_the_experts_and_weights_of_transformers_router(
    arch, norm_topk_prob
) -> None:
    model = hf_tiny(arch, norm_topk_prob)
    spec = parse_spec(model.config.to_dict())
    if norm_topk_prob is not None:
        assert spec.norm_topk_prob is norm_topk_prob
    x = torch.randn(64, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    blocks = moe_blocks(model)
    assert blocks, arch
    for layer, block, router in blocks:
        linear = getattr(router, "layer", router)  # DBRX's router holds an nn.Linear
        with torch.no_grad():
            want = hf_routing(block, router, x)
            got = route(
                x,
                linear.weight,
                spec,
                bias=getattr(linear, "bias", None),
                correction=getattr(router, "e_score_correction_bias", None),
            )
        (want_e, want_w), (got_e, got_w) = by_expert(want), by_expert(got)
        assert torch.equal(got_e, want_e), (arch, layer)
        assert got_w.dtype == want_w.dtype, (arch, layer)
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0, msg=f"{arch} layer {layer}")
        if spec.norm_topk_prob and spec.router != "sigmoid_group":  # they sum to 1
            torch.testing.assert_close(got_w.sum(-1), torch.ones(len(x)))


@pytest.mark.parametrize("layout", ["panels", "plain"])
def test_a_layers_experts_together_are_each_expert_alone(layout) -> None:
    if layout == "panels" and bf16.kernel("moe_silu_ffns") is None:
        pytest.skip("no C compiler or no AVX2: no bfloat16 panels")
    gen = torch.Generator().manual_seed(0)

    def weight(*shape: int):
        w = (torch.randn(*shape, generator=gen) / shape[1] ** 0.5).bfloat16()
        return bf16.Panels(w) if layout == "panels" else w

    experts = [FFNWeights(gate_up=weight(128, 64), down=weight(64, 64)) for _ in range(3)]
    xs = [torch.randn(n, 64, generator=gen).bfloat16() for n in (1, 5, 2)]
    together = experts_ffn(list(zip(xs, experts)))
    assert all(torch.equal(a, expert_ffn(x, w)) for a, x, w in zip(together, xs, experts))
