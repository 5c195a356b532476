"""The layout and decode threads a process measures at start-up, and the products `linear` computes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from common import bf16, float32_rows
from common import linear as L


@pytest.fixture
def fresh(monkeypatch):
    """A process that has measured nothing yet, on a small working set."""
    monkeypatch.delenv("MOE_MESH_PREPACK", raising=False)
    monkeypatch.setattr(L, "_WORKING_SET", 4 << 20)
    caches = (L.packed, L.panels, L.serial_tokens)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def timed(monkeypatch, seconds) -> list[tuple[int, str, int]]:
    """Replace the timer: `seconds(rows, kernel, threads)` is what each measurement takes."""
    calls = []

    def fake(weights, rows, product, repeats=3):
        kernel = "packed" if product is L._packed_linear else "plain"
        if product is L.linear and isinstance(weights[0], (bf16.Panels, float32_rows.Rows)):
            kernel = "panels"
        calls.append((rows, kernel, torch.get_num_threads()))
        return seconds(rows, kernel, torch.get_num_threads())

    monkeypatch.setattr(L, "_seconds", fake)
    return calls


@pytest.mark.skipif(not L._can_pack(torch.float32), reason="this torch has no oneDNN linear")
@pytest.mark.parametrize(("packed_share", "chosen"), [(0.5, True), (0.95, False), (1.3, False)])
def test_the_layout_is_prepacked_only_when_clearly_faster(fresh, monkeypatch, packed_share, chosen):
    monkeypatch.setattr(L, "_same_bits", lambda: True)
    calls = timed(
        monkeypatch, lambda rows, kernel, _: rows * (packed_share if kernel == "packed" else 1)
    )
    assert L.packed(torch.float32) is chosen
    assert sorted({rows for rows, _, _ in calls}) == [1, 4, 16, 64]
    assert L.prepack(torch.randn(8, 4)).is_mkldnn is chosen
    L.packed(torch.float32)
    assert len(calls) == 8  # measured once per process


def test_float32_stays_plain_where_prepacked_products_differ_in_the_last_bits(fresh, monkeypatch):
    calls = timed(monkeypatch, lambda rows, kernel, _: 0.1 if kernel == "packed" else 1.0)
    monkeypatch.setattr(L, "_same_bits", lambda: False)
    assert L.packed(torch.float32) is False and calls == []  # however fast it would be
    if L._can_pack(torch.bfloat16):  # 16-bit parity is bounded, not exact: speed decides
        assert L.packed(torch.bfloat16) is True


@pytest.mark.skipif(not L._can_pack(torch.float32), reason="this torch has no oneDNN linear")
def test_the_bit_check_compares_real_products(fresh):
    w, x = torch.randn(256, 1024), torch.randn(3, 1024)
    same = torch.equal(
        L._packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(w)), F.linear(x, w)
    )
    assert L._same_bits() in (same, False)  # one differing shape is enough to say no


@pytest.mark.parametrize("setting", ["on", "off"])
def test_moe_mesh_prepack_decides_without_measuring(fresh, monkeypatch, setting):
    calls = timed(monkeypatch, lambda *_: 1.0)
    monkeypatch.setenv("MOE_MESH_PREPACK", setting)
    expected = setting == "on" and L._can_pack(torch.float32)
    assert L.packed(torch.float32) is expected and calls == []
    assert L.prepack(torch.randn(8, 4)).is_mkldnn is expected


@pytest.mark.parametrize(
    ("speedups", "serial", "sizes_timed"),
    [
        ({1: 1.2, 4: 1.2, 16: 1.25, 32: 1.1}, 32, [1, 4, 16, 32]),
        ({1: 1.2, 4: 1.25, 16: 1.6, 32: 1.1}, 4, [1, 4, 16]),  # the first size that gains ends it
        ({1: 1.4, 4: 1.0, 16: 1.0, 32: 1.0}, 0, [1]),
    ],
)
def test_decode_passes_keep_one_thread_up_to_the_size_more_threads_speed_up(
    fresh, monkeypatch, speedups, serial, sizes_timed
):
    monkeypatch.setenv("MOE_MESH_PREPACK", "off")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calls = timed(monkeypatch, lambda rows, kernel, n: 1.0 if n == 1 else 1 / speedups[rows])
        assert L.serial_tokens(torch.float32) == serial
        assert [(rows, n) for rows, _, n in calls] == [(r, n) for r in sizes_timed for n in (2, 1)]
        assert torch.get_num_threads() == 2  # put back
    finally:
        torch.set_num_threads(threads)


def test_measuring_times_the_real_kernels(fresh, monkeypatch):
    """Real timings, whatever they say on this host: the layout follows the ratio measured."""
    ratios: list[float] = []
    measure = L._time_ratio

    def recorded(candidate, baseline) -> float:
        ratios.append(measure(candidate, baseline))
        return ratios[-1]

    monkeypatch.setattr(L, "_time_ratio", recorded)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ratios.clear()
        chosen = L.packed(dtype)
        if ratios:  # measured: the margin decides
            assert len(ratios) == 1 and 0 < ratios[0] < math.inf, ratios
            assert chosen is (ratios[0] < L._MARGIN), (dtype, ratios)
        else:  # only what oneDNN has, and float32 only where its bits are torch's, is timed
            assert chosen is False
            assert not L._can_pack(dtype) or (dtype == torch.float32 and not L._same_bits())
        assert L.serial_tokens(dtype) in (0, 1, 4, 16, 32)


@pytest.mark.parametrize("pack", [False, True])
def test_products_are_torchs_within_rounding(pack):
    if pack and not L._can_pack(torch.float32):
        pytest.skip("this torch build has no oneDNN linear kernels")
    w, b, x = torch.randn(48, 32), torch.randn(48), torch.randn(5, 32)
    weight = torch.ops.mkldnn._reorder_linear_weight(w) if pack else w
    y = L.linear(x, weight, b)
    if pack:
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(y, F.linear(x, w, b))


@pytest.mark.skipif(not L._can_pack(torch.float32), reason="this torch has no oneDNN linear")
@pytest.mark.parametrize("setting", ["auto", "on"])
def test_batch_invariant_weights_give_a_row_the_same_bits_whatever_its_batch_mates(
    fresh, monkeypatch, setting
):
    """float32: as stored, by moe-mesh's kernel, where it runs; MOE_MESH_PREPACK=on: oneDNN's."""
    as_stored = setting == "auto" and bf16.kernel("moe_f32_linear") is not None
    monkeypatch.setattr(L, "_same_bits", lambda: False)  # the measured choice would stay plain
    w, x = torch.randn(2048, 1024), torch.randn(40, 1024)
    assert isinstance(L.prepack(w), torch.Tensor) and not L.prepack(w).is_mkldnn
    monkeypatch.setenv("MOE_MESH_PREPACK", setting)
    weight = L.prepack(w, batch_invariant=True)
    assert isinstance(weight, float32_rows.Rows) is as_stored
    assert weight.is_mkldnn is not as_stored
    assert not as_stored or weight.data is w  # the weight itself: no copy
    for rows in (1, 3, 8, 16):
        assert torch.equal(L.linear(x[:rows], weight), L.linear(x, weight)[:rows])
    torch.testing.assert_close(L.linear(x, weight), F.linear(x, w), rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("MOE_MESH_PREPACK", "off")
    assert isinstance(L.prepack(w, batch_invariant=True), torch.Tensor)
    assert not L.prepack(w, batch_invariant=True).is_mkldnn


@pytest.mark.skipif(bf16.kernel("moe_linear") is None, reason="no C compiler or no AVX2")
def test_bfloat16_weights_are_panels_wherever_the_kernel_runs_without_measuring(fresh, monkeypatch):
    # However much faster another layout would time: every process on a host holds the same one.
    calls = timed(monkeypatch, lambda rows, kernel, _: 10.0 if kernel == "panels" else 1.0)
    assert L.panels(torch.bfloat16) and not L.panels(torch.float32)  # float32 keeps torch's bits
    w = torch.randn(128, 32).bfloat16()
    assert isinstance(L.prepack(w), bf16.Panels)
    assert isinstance(L.prepack(w, batch_invariant=True), bf16.Panels)
    assert calls == []
    x = torch.randn(3, 32).bfloat16()
    torch.testing.assert_close(L.linear(x, L.prepack(w)), F.linear(x, w), rtol=1e-2, atol=1e-2)
    monkeypatch.setenv("MOE_MESH_PREPACK", "on")
    L.panels.cache_clear()
    assert not L.panels(torch.bfloat16) and not isinstance(L.prepack(w), bf16.Panels)


@pytest.mark.skipif(bf16.kernel("moe_linear") is None, reason="no C compiler or no AVX2")
def test_moe_mesh_prepack_panels_and_off_decide_the_bfloat16_layout_without_measuring(
    fresh, monkeypatch
):
    calls = timed(monkeypatch, lambda *_: 1.0)
    w = torch.randn(64, 32).bfloat16()
    monkeypatch.setenv("MOE_MESH_PREPACK", "panels")
    assert L.panels(torch.bfloat16) and isinstance(L.prepack(w), bf16.Panels)
    assert not isinstance(L.prepack(torch.randn(96, 32).bfloat16()), bf16.Panels)  # cannot hold
    L.panels.cache_clear()
    L.packed.cache_clear()
    monkeypatch.setenv("MOE_MESH_PREPACK", "off")
    assert not L.panels(torch.bfloat16) and L.prepack(w) is w
    assert calls == []


@pytest.mark.skipif(bf16.library() is None, reason="no C compiler here: no bf16 kernel")
def test_bfloat16_weights_stay_torchs_where_this_cpu_cannot_run_the_kernel(fresh, monkeypatch):
    calls = timed(monkeypatch, lambda *_: 1.0)
    monkeypatch.setattr(bf16.library(), "level", 0)  # neither AVX2+FMA nor AVX-512
    monkeypatch.setenv("MOE_MESH_PREPACK", "panels")  # even where asked for
    assert not L.panels(torch.bfloat16) and calls == []
    assert not isinstance(L.prepack(torch.randn(64, 32).bfloat16()), bf16.Panels)
