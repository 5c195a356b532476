"""A lone token is grouped and combined without index tensors (common/moe.py), to the same bits
as the same token in a batch."""

from __future__ import annotations

import pytest
import torch

from moe_mesh.common.moe import Routing, combine, group_by_expert


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
