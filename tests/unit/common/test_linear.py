"""The kernel plan (measured once per host, cached) and the products `linear` computes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from moe_mesh.common import linear as L


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not planned yet, caching in a file of its own."""
    monkeypatch.setenv("MOE_MESH_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.delenv("MOE_MESH_PREPACK", raising=False)
    L.plan.cache_clear()
    yield tmp_path / "kernels.json"
    L.plan.cache_clear()


def counting(monkeypatch, result: L.KernelPlan) -> list[torch.dtype]:
    calls: list[torch.dtype] = []

    def measure(dtype):
        calls.append(dtype)
        return result

    monkeypatch.setattr(L, "_measure", measure)
    return calls


def test_a_plan_is_measured_once_per_host_then_read_from_the_cache(fresh, monkeypatch):
    calls = counting(monkeypatch, L.KernelPlan(True, False, 0.5))
    first = L.plan(torch.bfloat16)
    assert calls == [torch.bfloat16] and (first.packed, first.serial) == (True, False)
    entry = json.loads(fresh.read_text())
    assert [k.endswith("torch.bfloat16") for k in entry] == [True]

    L.plan.cache_clear()  # a new process on the same host
    again = L.plan(torch.bfloat16)
    assert calls == [torch.bfloat16]
    assert (again.packed, again.serial, again.seconds) == (True, False, 0.0)


def test_a_torn_or_foreign_cache_is_measured_again(fresh, monkeypatch):
    calls = counting(monkeypatch, L.KernelPlan(False, True))
    fresh.write_text('{"oops": ')
    L.plan(torch.float32)
    key = L._host_key(torch.float32)
    fresh.write_text(json.dumps({key: {"packed": "yes", "serial": 1}}))
    L.plan.cache_clear()
    L.plan(torch.float32)
    assert calls == [torch.float32, torch.float32]
    assert json.loads(fresh.read_text())[key]["packed"] is False


def test_cache_off_measures_every_start_and_writes_nothing(fresh, monkeypatch):
    monkeypatch.setenv("MOE_MESH_KERNEL_CACHE", "off")
    calls = counting(monkeypatch, L.KernelPlan(False, True))
    L.plan(torch.float32)
    L.plan.cache_clear()
    L.plan(torch.float32)
    assert len(calls) == 2 and not fresh.exists()


@pytest.mark.parametrize("setting", ["on", "off"])
def test_moe_mesh_prepack_overrides_the_measured_layout(fresh, monkeypatch, setting):
    counting(monkeypatch, L.KernelPlan(setting == "off", True))
    monkeypatch.setenv("MOE_MESH_PREPACK", setting)
    w = torch.randn(64, 32)
    assert L.plan(torch.float32).packed is (setting == "on" and L._can_pack(torch.float32))
    assert L.prepack(w).is_mkldnn is L.plan(torch.float32).packed


def test_measuring_times_the_real_kernels_and_decides_each_question(fresh):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        p = L._measure(dtype, working_set=4 << 20)
        assert isinstance(p.packed, bool) and isinstance(p.serial, bool) and p.seconds > 0
        assert L._can_pack(dtype) or not p.packed  # only what oneDNN has is ever chosen
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one thread is all there is
        assert L._measure(torch.float32, working_set=4 << 20).serial
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("pack", [False, True])
def test_float32_products_are_torchs_within_rounding(pack):
    if pack and not L._can_pack(torch.float32):
        pytest.skip("this torch build has no oneDNN linear kernels")
    w, b, x = torch.randn(48, 32), torch.randn(48), torch.randn(5, 32)
    weight = torch.ops.mkldnn._reorder_linear_weight(w) if pack else w
    y = L.linear(x, weight, b)
    if pack:
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(y, F.linear(x, w, b))
