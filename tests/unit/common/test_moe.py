"""common/moe.py: a lone token is grouped and combined without index tensors, to the same bits as
the same token in a batch; a layer's rows are gathered once and a service's groups sent as one view."""

from __future__ import annotations

import pytest
import torch

from common.moe import Routing, combine, gather_rows, group_by_expert, joined


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
