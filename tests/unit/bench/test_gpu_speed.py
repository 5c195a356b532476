"""bench/gpu_speed.py: decode rates from timed runs (noise that leaves no decode time gives no
rate, not a huge one), each batch's row, and the meshes part d starts."""

from __future__ import annotations

import time

from bench import gpu_speed
from bench.gpu_speed import mesh_setups, ratio_row, side_rates
from bench.gpu_support import Context


def test_side_rates_take_the_fastest_runs_difference(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_speed, "NEW_TOKENS", 5)
    monkeypatch.setattr(gpu_speed, "REPEATS", 2)
    times = {1: iter([9.0, 1.0]), 5: iter([3.0, 2.0])}  # after a warm-up of 2 tokens

    def run(prompts, k):
        return (0.5 if k == 2 else next(times[k])), [[k]] * len(prompts)

    ctx = Context("cpu", tmp_path, time.monotonic() + 60)
    got = side_rates(ctx, run, {4: [[1], [2], [3], [4]]})
    assert got == {4: (4 * 4 / (2.0 - 1.0), [[5]] * 4)}


def test_side_rates_give_no_rate_where_noise_leaves_no_decode_time(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_speed, "REPEATS", 1)
    ctx = Context("cpu", tmp_path, time.monotonic() + 60)
    got = side_rates(ctx, lambda p, k: (1.0, [[0]]), {1: [[1]]})
    assert got[1][0] is None


def test_side_rates_leave_out_batches_past_the_time_bound(tmp_path) -> None:
    ctx = Context("cpu", tmp_path, time.monotonic() + 5)
    assert side_rates(ctx, lambda p, k: (1.0, [[0]]), {1: [[1]]}) == {}


def test_ratio_row() -> None:
    row = ratio_row(300.0, 100.0, 1e-3)
    assert row == {
        "engine_tokens_per_s": 300.0, "transformers_tokens_per_s": 100.0,
        "ratio": 3.0, "bandwidth_share": 0.3,
    }  # fmt: skip
    assert ratio_row(None, 100.0, 1e-3) == {
        "engine_tokens_per_s": None, "transformers_tokens_per_s": 100.0,
    }  # fmt: skip


def test_mesh_setups() -> None:
    grpc_only = mesh_setups("cuda", ucx=False)
    assert list(grpc_only) == ["all on cuda, gRPC", "router on cuda, experts on cpu"]
    assert grpc_only["router on cuda, experts on cpu"][-4:] == [
        "--device", "cuda", "--expert-device", "cpu",
    ]  # fmt: skip
    both = mesh_setups("cuda:1", ucx=True)
    assert both["all on cuda:1, UCX"][-1] == "--router-arg=--fast-path=ucx"
    assert "--router-arg=--fast-path=off" in both["all on cuda:1, gRPC"]
