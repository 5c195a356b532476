"""float32 products split over the threads (common.float32): F.linear's bits, where and when."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common import float32
from common import linear as L

needs_split = pytest.mark.skipif(
    float32.mkl() is None or float32.bf16.kernel("moe_sgemm_rows") is None,
    reason="torch's BLAS is not MKL here, or the kernels are not built here",
)


def verdicts() -> dict:
    """float32's verdicts without the operands' offsets (fresh tensors lie on cache lines)."""
    return {key[:5]: same for key, same in float32._verdicts.items()}


@pytest.fixture
def fresh(monkeypatch):
    """Two torch threads, and nothing checked yet."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(float32, "_verdicts", {})
    yield
    torch.set_num_threads(before)


@needs_split
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_the_kernel_computes_the_product(threads):
    """Against float64, whatever the shares: 64-row blocks over `threads`, widths of any size."""
    gen = torch.Generator().manual_seed(1)
    for out, k, m in ((64, 1024, 1), (1472, 520, 3), (8192, 1024, 16), (320, 7, 64)):
        w, x = torch.randn(out, k, generator=gen), torch.randn(m, k, generator=gen)
        want = (x.double() @ w.double().T).float()
        torch.testing.assert_close(float32._split(x, w, threads), want, rtol=1e-5, atol=1e-4)


@needs_split
def test_one_row_products_split_with_f_linears_bits_where_mkl_computes_them(fresh, monkeypatch):
    monkeypatch.setattr(float32, "faster", lambda threads: True)
    w, x = torch.randn(1536, 1024), torch.randn(1, 1024)
    assert torch.equal(L.linear(x, w), F.linear(x, w))
    assert verdicts() == {("split", 1536, 1024, 1, 2): True}  # one row, any block (sgemv4's too)


def sgemv4_order(x: torch.Tensor, w: torch.Tensor, offset: int) -> torch.Tensor:
    """common/sgemv4.c's sums, spelled out in float32 ops (each rounded, none fused) over the
    rows of w, whose first element lies `offset` floats past 16 bytes."""
    k = x.numel()
    head = min((k - 1 - offset) % 4 + 1, k)
    body = head + (k - head) // 4 * 4
    s = x[0] * w[:, 0]
    for i in range(1, head):
        s = s + x[i] * w[:, i]
    lanes = [s] + [torch.zeros_like(s) for _ in range(3)]
    for i in range(head, body, 4):
        for lane in range(4):
            lanes[lane] = lanes[lane] + x[i + lane] * w[:, i + lane]
    total = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
    for i in range(body, k):
        total = total + x[i] * w[:, i]
    return total


needs_sgemv4 = pytest.mark.skipif(
    float32.bf16.kernel("moe_sgemv4") is None, reason="the kernels are not built here"
)


@needs_sgemv4
@pytest.mark.parametrize("k", [1, 3, 6, 33, 770, 1023, 1024])
def test_sgemv4_sums_in_the_order_it_documents(k):
    gen = torch.Generator().manual_seed(k)
    for start in range(4):
        w = torch.randn(11 * k + start, generator=gen)[start:].view(11, k)  # 8 rows, then 3
        x, y = torch.randn(k, generator=gen), torch.empty(11)
        float32.bf16.call(float32.bf16.kernel("moe_sgemv4"), x, w, y, 11, k)
        assert torch.equal(y, sgemv4_order(x, w, w.data_ptr() // 4 % 4))


@needs_sgemv4
@pytest.mark.parametrize("k", [1023, 1024])
def test_the_split_gives_one_row_sgemv4s_bits_of_the_whole_weight(k):
    """Each thread's 64-row blocks start where the whole weight's alignment holds."""
    kernel = float32.bf16.kernel
    w, x = torch.randn(1 + 192 * k)[1:].view(192, k), torch.randn(1, k)
    whole, split = torch.empty(192), torch.empty(1, 192)
    float32.bf16.call(kernel("moe_sgemv4"), x, w, whole, 192, k)
    kernel("moe_sgemv4_use")(1)
    try:  # MKL's addresses go unused: every product here is one row
        float32.bf16.call(kernel("moe_sgemm_rows"), None, None, x, w, split, 1, 192, k, 3)
    finally:
        kernel("moe_sgemv4_use")(0)
        float32.mkl()  # back to what this host's MKL asks for
    assert torch.equal(split[0], whole)


@pytest.mark.parametrize(("way", "rows"), [("split", 2), ("lanes", 8)])
@pytest.mark.parametrize("same", [True, False])
def test_each_shape_runs_another_way_only_once_its_bits_were_seen_equal(
    fresh, monkeypatch, same, way, rows
):
    monkeypatch.setattr(float32, "faster", lambda threads: way == "split")  # one way at a time
    monkeypatch.setattr(float32.bf16, "kernel", lambda name: "built")
    calls = []

    def product(x, w, threads):
        calls.append(threads)
        return F.linear(x, w) if same else F.linear(x, w) + 1e-3

    monkeypatch.setattr(float32, f"_{way}", product)
    w, x = torch.randn(128, 64), torch.randn(rows, 64)
    for _ in range(3):
        assert torch.equal(L.linear(x, w), F.linear(x, w))  # F.linear's bits either way
    assert verdicts() == {(way, 128, 64, rows, 2): same}
    assert len(calls) == (3 if same else 1)  # a shape that differed never runs so again
    L.linear(torch.randn(rows + 1, 64), w)
    assert (way, 128, 64, rows + 1, 2) in verdicts()  # another row count: checked too


def test_what_the_kernels_cannot_take_goes_to_f_linear(fresh, monkeypatch):
    monkeypatch.setattr(float32, "faster", lambda threads: True)
    monkeypatch.setattr(float32, "_split", lambda *a: pytest.fail("split"))
    monkeypatch.setattr(float32, "_lanes", lambda *a: pytest.fail("lanes"))
    w, x = torch.randn(128, 64), torch.randn(4, 64)
    for args in (
        (torch.randn(3, 64), torch.randn(100, 64)),  # rows not in 64-row blocks
        (x, w, torch.zeros(128)),  # a bias: torch adds it its way
        (torch.randn(65, 64), w),  # more rows than a decode step
        (x.t().contiguous().t(), w),  # an input's columns apart
        (torch.randn(4, 0), torch.randn(128, 0)),  # nothing to sum
        (torch.randn(8, 24), torch.randn(100, 24)),  # inputs not in 16s, rows not in 64s
        (torch.randn(8, 64), torch.randn(128, 128)[:, :64]),  # a weight's rows apart
    ):
        assert torch.equal(L.linear(*args), F.linear(*args))
    with pytest.raises(RuntimeError):  # widths that do not match: torch's error, no read past x
        L.linear(torch.randn(1, 64), torch.randn(128, 4096))
    for args in ((torch.tensor(1.0), w), (x, torch.tensor(1.0))):  # no rows: torch's error too
        with pytest.raises(RuntimeError):
            L.linear(*args)
    with float32.unsplit():
        assert torch.equal(L.linear(x, w), F.linear(x, w))
    torch.set_num_threads(1)  # one thread: nothing to split over
    x = torch.randn(3, 64)
    assert torch.equal(L.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("rows", [3, 6])
def test_a_serial_pass_computes_its_products_on_the_whole_team(fresh, monkeypatch, rows):
    """torch on one thread for the pass's small ops; an unsplit product runs on the team all the
    same, as F.linear's bits at some row counts depend on its threads."""
    monkeypatch.setattr(float32, "faster", lambda threads: False)
    seen = []
    real = F.linear
    monkeypatch.setattr(
        float32.F, "linear", lambda *a: seen.append(torch.get_num_threads()) or real(*a)
    )
    torch.set_num_threads(1)
    with float32.team(2):
        L.linear(torch.randn(rows, 64), torch.randn(128, 64))
        assert torch.get_num_threads() == 1  # and back
    assert seen == [2]


needs_lanes = pytest.mark.skipif(
    float32.bf16.kernel("moe_sgemm_lanes16") is None,
    reason="needs a CPU with AVX-512 (common/f32_lanes.c is AVX-512 code) and a C compiler",
)
# Where MKL's products of 4-15 rows were seen to sum as f32_lanes.c does: Intel's AVX-512 (host
# C). Elsewhere each shape's check decides, and these tests ask only for F.linear's bits.
PROBED_HERE = (
    float32.bf16.kernel("moe_sgemm_lanes16") is not None
    and float32.mkl() is not None
    and "GenuineIntel" in Path("/proc/cpuinfo").read_text()
)


@needs_lanes
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_lanes_kernel_computes_the_product(threads):
    """Against float64, with weight rows past the last block of 4 and shares of any size."""
    gen = torch.Generator().manual_seed(2)
    run = float32.bf16.kernel("moe_sgemm_lanes16")
    shapes = ((64, 1024, 4), (1474, 528, 15), (6, 2048, 7), (130, 16, 9), (64, 64, 2))
    for out, k, m in (*shapes, (70, 1024, 1), (8, 16, 1), (3, 2048, 1)):  # and sgemv's order
        w, x = torch.randn(out, k, generator=gen), torch.randn(m, k, generator=gen)
        y = torch.empty(m, out)
        assert float32.bf16.call(run, x, w, y, m, out, k, threads) == 0
        want = (x.double() @ w.double().T).float()
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    for m, k in ((16, 64), (4, 24), (1, 24)):  # what MKL does not sum so: refused
        assert float32.bf16.call(run, torch.ones(m, k), torch.ones(64, k), y, m, 64, k, 2) == -1


def test_where_the_lanes_bits_differ_the_split_is_tried(fresh, monkeypatch):
    monkeypatch.setattr(float32, "faster", lambda threads: True)
    monkeypatch.setattr(float32.bf16, "kernel", lambda name: "built")
    monkeypatch.setattr(float32, "_lanes", lambda x, w, threads: F.linear(x, w) + 1e-3)
    splits = []
    monkeypatch.setattr(
        float32, "_split", lambda x, w, threads: splits.append(threads) or F.linear(x, w)
    )
    w, x = torch.randn(128, 64), torch.randn(8, 64)
    for _ in range(3):
        assert torch.equal(L.linear(x, w), F.linear(x, w))
    assert verdicts() == {("lanes", 128, 64, 8, 2): False, ("split", 128, 64, 8, 2): True}
    assert splits == [2, 2]  # checked at the second call, then run


def test_a_verdict_holds_only_for_operands_that_lie_as_they_did(fresh, monkeypatch):
    """MKL's sums may depend on where the operands lie, a moe-mesh kernel's do not: a weight
    (a view of a checkpoint file) 16 bytes off a cache line is checked for itself."""
    monkeypatch.setattr(float32, "faster", lambda threads: False)
    monkeypatch.setattr(float32.bf16, "kernel", lambda name: "built")
    monkeypatch.setattr(float32, "_lanes", lambda x, w, threads: F.linear(x, w))
    flat, x = torch.randn(128 * 64 + 4), torch.randn(8, 64)
    for w in (flat[: 128 * 64].view(128, 64), flat[4:].view(128, 64)):
        assert torch.equal(L.linear(x, w), F.linear(x, w))
    assert sorted(key[5] for key in float32._verdicts) == [0, 16]


@pytest.mark.parametrize("threads", [1, 2])
def test_products_of_4_to_15_rows_run_on_the_lanes_kernel_with_f_linears_bits(fresh, threads):
    """At a small model's and the Qwen3 and Mixtral slices' shapes; on one thread too (a serial
    pass's team). Where MKL was not probed (PROBED_HERE), only F.linear's bits are asked for:
    they hold whichever way computed the products."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(3)
    for out, k in ((1536, 1024), (2048, 768), (768, 2048), (512, 14336)):
        w = torch.randn(out, k, generator=gen)
        for m in float32.LANES_ROWS:
            x = torch.randn(m, k, generator=gen)
            for _ in range(2):  # checked, then computed as the check found
                assert torch.equal(L.linear(x, w), F.linear(x, w))
    lanes = [same for key, same in float32._verdicts.items() if key[0] == "lanes"]
    if PROBED_HERE:
        assert len(lanes) == 4 * len(float32.LANES_ROWS) and all(lanes)


@pytest.mark.skipif(not PROBED_HERE, reason="MKL's one-row order was probed on Intel's AVX-512")
@pytest.mark.parametrize("threads", [1, 2])
def test_one_row_products_on_the_lanes_kernel_give_f_linears_bits(fresh, threads):
    """sgemv's order (f32_lanes.c's GEMV16) at the shapes of test_products_of_4_to_15_rows..."""
    gen = torch.Generator().manual_seed(4)
    for out, k in ((1536, 1024), (2048, 768), (768, 2048), (512, 14336)):
        assert float32.lanes_agree(1, torch.randn(out, k, generator=gen), threads)


@needs_lanes
def test_below_avx512_the_lanes_way_gives_f_linears_product_and_no_verdict(fresh):
    """The kernels held to AVX2 (moe_bf16_limit, as tests of the AVX2 code do): the call refuses,
    F.linear computes the product, and nothing is decided for when the kernel runs again."""
    w, x = torch.randn(128, 64), torch.randn(8, 64)
    limit = float32.bf16.kernel("moe_bf16_limit")
    limit(1)
    try:
        assert float32._lanes(x, w, 2) is None
        assert torch.equal(L.linear(x, w), F.linear(x, w)) and "lanes" not in {
            key[0] for key in verdicts()
        }
    finally:
        limit(3)


@pytest.fixture
def unmeasured():
    """A process that has not timed the split yet, and forgets what a test made it find."""
    float32.faster.cache_clear()
    yield
    float32.faster.cache_clear()


def test_nothing_is_split_on_one_thread_or_without_mkl(unmeasured, monkeypatch):
    assert float32.faster(1) is False
    monkeypatch.setattr(float32, "mkl", lambda: None)
    assert float32.faster(2) is False


@needs_split
@pytest.mark.parametrize(("ratio", "chosen"), [(0.95, False), (0.6, True)])
def test_products_are_split_only_where_splitting_was_faster(unmeasured, monkeypatch, ratio, chosen):
    monkeypatch.setattr(float32, "_time_ratio", lambda threads: ratio)
    assert float32.faster(2) is chosen


@needs_split
def test_the_timing_times_real_products(monkeypatch):
    monkeypatch.setattr(float32, "_WORKING_SET", 16 << 20)
    calls = []
    monkeypatch.setattr(float32, "_split", lambda x, w, threads: calls.append(x.shape[0]))
    float32._time_ratio(2)
    assert sorted(set(calls)) == [1, 4] and len(calls) == 2 * 3 * 2  # 2 weights, 3 passes
