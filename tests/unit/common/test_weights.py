"""FFNWeights: its byte count, whichever way gate and up are held."""

from __future__ import annotations

import torch

from common.moe import expert_ffn
from common.weights import FFNWeights


def test_bytes_count_gate_and_up_alike_joined_or_apart() -> None:
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    joined = FFNWeights.from_parts(gate, up, down)
    apart = FFNWeights(gate_up=gate, up=up, down=down)
    assert joined.nbytes == apart.nbytes == 3 * 24 * 4


def test_gate_and_up_apart_compute_the_same_ffn() -> None:
    gen = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(*s, generator=gen) for s in ((6, 4), (6, 4), (4, 6)))
    x = torch.randn(3, 4, generator=gen)
    joined = expert_ffn(x, FFNWeights.from_parts(gate, up, down))
    apart = expert_ffn(x, FFNWeights(gate_up=gate, up=up, down=down))
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(apart, expected)
    torch.testing.assert_close(joined, apart)
