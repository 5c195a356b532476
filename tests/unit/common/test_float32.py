"""float32 products split over the threads (common.float32): F.linear's bits, where and when."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common import float32
from common import linear as L

needs_split = pytest.mark.skipif(
    float32._sgemm() is None or float32.bf16.kernel("moe_sgemm_rows") is None,
    reason="this torch has no sgemm to find, or the kernels are not built here",
)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@needs_split
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_the_split_gives_every_row_count_it_takes_the_bits_of_f_linear(two_threads, threads):
    """At the row counts the process found equal, on weights other than the ones it checked
    (rows not a multiple of the threads' share, an input width not a multiple of 8)."""
    taken = float32._same_bits(2)
    assert {1, 2, 4, 16, 32, 64} <= taken  # decode sizes: one sequence, a few, a full batch
    gen = torch.Generator().manual_seed(1)
    for out, k in ((64, 1024), (1472, 520), (8192, 1024)):
        w = torch.randn(out, k, generator=gen)
        for m in sorted(taken)[::7]:
            x = torch.randn(m, k, generator=gen)
            assert torch.equal(float32._split(x, w, threads), F.linear(x, w)), (out, k, m)


@needs_split
def test_linear_splits_only_what_it_can_and_otherwise_leaves_it_to_f_linear(
    two_threads, monkeypatch
):
    monkeypatch.setattr(float32, "rows", lambda threads: frozenset({1, 4}))
    split = []
    monkeypatch.setattr(float32, "_split", lambda x, w, threads: split.append(threads) or "split")
    w, x = torch.randn(128, 64), torch.randn(4, 64)
    assert L.linear(x, w) == "split" and split == [2]
    assert L.linear(torch.randn(3, 64), w).shape == (3, 128)  # a row count not taken
    assert L.linear(x, torch.randn(100, 64)).shape == (4, 100)  # rows not in 64-row blocks
    assert L.linear(x, w, torch.zeros(128)).shape == (4, 128)  # a bias: torch adds it its way
    assert L.linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    assert L.linear(x.t().contiguous().t(), w).shape == (4, 128)  # columns apart
    with float32.unsplit():
        assert L.linear(x, w).shape == (4, 128)
    torch.set_num_threads(1)
    assert L.linear(x, w).shape == (4, 128)  # one thread: nothing to split over
    with float32.team(2):  # a serial pass: its products still take the whole team
        assert L.linear(x, w) == "split"
    assert split == [2, 2]


def test_nothing_is_split_on_one_thread_or_without_the_kernel(monkeypatch):
    assert float32.rows(1) == frozenset()
    float32.rows.cache_clear()
    monkeypatch.setattr(float32, "_sgemm", lambda: None)
    try:
        assert float32.rows(2) == frozenset()
    finally:
        float32.rows.cache_clear()


@needs_split
def test_rows_are_split_only_where_splitting_is_faster(monkeypatch):
    float32.rows.cache_clear()
    monkeypatch.setattr(float32, "_WORKING_SET", 4 << 20)
    try:
        monkeypatch.setattr(float32, "_time_ratio", lambda threads: 0.95)
        assert float32.rows(2) == frozenset()
        float32.rows.cache_clear()
        monkeypatch.setattr(float32, "_time_ratio", lambda threads: 0.6)
        assert 1 in float32.rows(2)
        float32.rows.cache_clear()
        assert 0 < float32._time_ratio(2) < 10  # really timed, both ways
    finally:
        float32.rows.cache_clear()
