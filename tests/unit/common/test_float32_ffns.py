"""A layer's float32 experts in one kernel call (common.float32_ffns): op by op's bits, and op by op
wherever the kernel cannot give them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common import float32, float32_ffns
from common.moe import expert_ffn, experts_ffn
from common.weights import FFNWeights

pytestmark = pytest.mark.skipif(
    float32_ffns.bf16.kernel("moe_silu_ffns_f32") is None
    or float32.mkl() is None
    or float32.torch_lanes() is None
    or "GenuineIntel" not in Path("/proc/cpuinfo").read_text(),
    reason="needs AVX-512 and a C compiler (the kernel), and MKL on an Intel CPU: the sums "
    "common/f32_lanes.c repeats were probed there",
)
# INTER a multiple of 2 x 16 lanes (torch's SiLU has no scalar tail); at k of 256 and below, MKL
# sums 11 rows and more by other kernels, which f32_lanes.c does not repeat
HIDDEN, INTER = 512, 384


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Two torch threads, and nothing checked yet."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(float32, "_verdicts", {})
    monkeypatch.setattr(float32_ffns, "_verdicts", {})
    yield
    torch.set_num_threads(before)


def layer(
    joined: bool, rows: list[int], inter: int = INTER
) -> list[tuple[torch.Tensor, FFNWeights]]:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for m in rows:
        gate, up = (torch.randn(inter, HIDDEN, generator=gen) * 0.1 for _ in range(2))
        down = torch.randn(HIDDEN, inter, generator=gen) * 0.1
        w = FFNWeights(torch.cat([gate, up]), down) if joined else FFNWeights(gate, down, up=up)
        batches.append((torch.randn(m, HIDDEN, generator=gen), w))
    return batches


def experts(batches) -> list:
    return [(x, w.gate_up, w.up, w.down) for x, w in batches]


@pytest.mark.parametrize("joined", [True, False], ids=["gate_up", "apart"])
def test_a_layers_experts_in_one_call_give_op_by_ops_bits(joined):
    """Every row count the kernel takes, MKL's one-row (sgemv) and few-row (sgemm) orders alike;
    twice: a row count's first experts are held to op by op, later ones run as they found."""
    batches = layer(joined, [1, 2, 3, 4, 7, 8, 15, 1])
    want = [expert_ffn(x, w) for x, w in batches]
    for _ in range(2):
        got = float32_ffns.silu_ffns(experts(batches), lambda i: expert_ffn(*batches[i]))
        assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want))
        assert all(torch.equal(g, w) for g, w in zip(experts_ffn(batches), want))
    assert float32_ffns._verdicts == {
        (HIDDEN, INTER, joined, 2, 2, m): True for m in (1, 2, 3, 4, 7, 8, 15)
    }


def test_experts_the_kernel_cannot_take_are_computed_op_by_op():
    """16 rows (MKL sums those in blocks f32_lanes.c does not repeat), and rows off a cache line
    (a verdict holds for a new tensor's), go op by op; the rest in one call."""
    batches = layer(False, [2, 16, 1, 3])
    offset = torch.randn(3 * HIDDEN + 4)[4:].view(3, HIDDEN)
    batches[3] = (offset, batches[3][1])
    taken = float32_ffns.silu_ffns(experts(batches), lambda i: expert_ffn(*batches[i]))
    assert [y is not None for y in taken] == [True, False, True, False]
    got = experts_ffn(batches)
    assert all(torch.equal(g, expert_ffn(x, w)) for g, (x, w) in zip(got, batches))


def test_silu_that_torch_may_split_over_its_threads_goes_op_by_op():
    """From 32,768 values on several threads torch runs SiLU in pieces, which end in scalar tails
    of their own (libm's expf) wherever a piece's length is not a multiple of 32 (FFN 14,336 on 3
    threads: 1-5 values differed at 5-14 rows): such an expert is left to op by op."""
    torch.set_num_threads(3)
    batches = layer(True, [7, 9], inter=4096)  # 28,672 and 36,864 values
    taken = float32_ffns.silu_ffns(experts(batches), lambda i: expert_ffn(*batches[i]))
    assert [y is not None for y in taken] == [True, False]
    assert all(torch.equal(g, expert_ffn(x, w)) for g, (x, w) in zip(experts_ffn(batches), batches))


def test_a_serial_pass_runs_silu_in_one_piece_and_its_products_on_the_team():
    """A decode pass small enough for one torch thread still runs its products on the team
    (float32.team): torch's SiLU is then one piece at any size, and the expert is taken."""
    torch.set_num_threads(1)
    batches = layer(False, [9], inter=4096)  # 36,864 values
    with float32.team(2):
        taken = float32_ffns.silu_ffns(experts(batches), lambda i: expert_ffn(*batches[i]))
        assert taken[0] is not None and torch.equal(taken[0], expert_ffn(*batches[0]))
    assert float32_ffns._verdicts == {(HIDDEN, 4096, False, 2, 1, 9): True}


def test_a_row_count_whose_first_call_differs_from_op_by_op_is_never_fused(monkeypatch):
    batches = layer(True, [1, 1])
    wrong = float32_ffns.silu_ffns(experts(batches), lambda i: torch.zeros(1, HIDDEN))
    assert wrong == [None, None]
    assert float32_ffns._verdicts == {(HIDDEN, INTER, True, 2, 2, 1): False}
    monkeypatch.setattr(float32_ffns.bf16, "kernel", lambda name: lambda *a: pytest.fail("ran"))
    assert float32_ffns.silu_ffns(experts(batches), lambda i: pytest.fail("checked")) == [None] * 2
