"""The compute timings `moe-mesh profile` takes, on a tiny checkpoint: the router's and experts'
own code is what is timed, timings are medians per run, load shares are shares."""

from __future__ import annotations

import pytest
import torch

from common import bf16, float32_rows
from common.checkpoint import Checkpoint
from moe_mesh.planning import measure
from moe_mesh.planning.measure import LayerBench, timed


@pytest.fixture(scope="module")
def bench(checkpoint) -> LayerBench:
    return LayerBench(Checkpoint(checkpoint("qwen2_moe"), dtype=torch.float32))


@pytest.fixture
def runs(monkeypatch) -> list[tuple[object, list[int]]]:
    """What each timed function computes: its result, run once more after its timing, and the
    rows of every expert FFN that run called."""
    out: list[tuple[object, list[int]]] = []
    real_timed, real_ffn = measure.timed, measure.expert_ffn
    rows: list[int] = []

    def ffn(x, w):
        rows.append(len(x))
        return real_ffn(x, w)

    def spy(fn, repeats, *args, **kwargs):
        timing = real_timed(fn, repeats, *args, **kwargs)
        rows.clear()
        out.append((fn(), list(rows)))
        return timing

    monkeypatch.setattr(measure, "timed", spy)
    monkeypatch.setattr(measure, "expert_ffn", ffn)
    return out


def test_every_side_times_its_own_code(bench: LayerBench, runs) -> None:
    s = bench.spec
    for b in (1, 5):
        bench.router_layer(b, context=16, repeats=2)
        bench.expert_layer(b, repeats=2)
        bench.head(b, repeats=2)
        (layer, _), (_, expert_rows), (logits, _) = runs[-3:]
        assert layer.shape == (b, s.hidden_size) and bool(layer.isfinite().all())
        assert sum(expert_rows) == b * s.top_k  # every token's k experts, each once
        assert logits.shape == (b, s.vocab_size) and logits.dtype == torch.float32
    bench.expert_call((bench.layer_id, 0), bench.hidden(3), repeats=2)
    assert runs[-1][1] == [3]  # that expert, on those rows


def test_dense_layers_are_timed_only_when_the_model_has_them(bench: LayerBench) -> None:
    dense = bench.dense_layer(2, context=8, repeats=1)
    assert (dense is None) == all(bench.spec.moe_layers)


def test_load_shares_sum_to_one_per_moe_layer(bench: LayerBench) -> None:
    shares = bench.load_shares(256)
    assert sorted(shares) == bench.spec.moe_layer_ids
    for row in shares.values():
        assert len(row) == bench.spec.num_experts and sum(row) == pytest.approx(1.0)


def test_timed_reports_median_wall_and_cpu_per_run() -> None:
    """On fake clocks: run i (after two warm-ups) takes i + 1 s of wall time and 2 s of CPU."""
    calls: list[int] = []
    wall, cpu = [0.0], [0.0]

    def run() -> None:
        calls.append(1)
        wall[0] += len(calls) - 2
        cpu[0] += 2.0

    t = timed(run, repeats=5, warmup=2, clock=lambda: wall[0], cpu_clock=lambda: cpu[0])
    assert len(calls) == 7 and (t.wall_s, t.cpu_s) == (3.0, 2.0)  # median of 1..5


def test_a_latent_attention_model_with_dense_layers_is_timed(checkpoint, runs) -> None:
    path = checkpoint("deepseek_v3", overrides={"first_k_dense_replace": 1})
    bench = LayerBench(Checkpoint(path, dtype=torch.float32))
    assert bench.layer_id == 1
    bench.router_layer(3, context=16, repeats=1)
    bench.dense_layer(3, context=16, repeats=1)
    bench.expert_layer(3, repeats=1)
    (moe, _), (dense, _), (_, expert_rows) = runs
    assert moe.shape == dense.shape == (3, bench.spec.hidden_size)
    assert sum(expert_rows) == 3 * bench.spec.top_k
    shares = bench.load_shares(64)
    assert sorted(shares) == [1, 2] and sum(shares[1]) == pytest.approx(1.0)


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN kernels"
)
def test_expert_timings_use_the_layout_expert_services_hold(checkpoint, runs) -> None:
    path = checkpoint("qwen2_moe")
    service = Checkpoint(path, dtype=torch.float32, prepack=True, batch_invariant=True)
    bench = LayerBench(Checkpoint(path, dtype=torch.float32), experts=service)
    served = service.load_experts([(bench.layer_id, 0)])[(bench.layer_id, 0)]
    held = bench.experts[0].gate_up
    assert type(held) is type(served.gate_up)  # oneDNN's layout, or float32 as stored
    assert held.is_mkldnn or isinstance(held, float32_rows.Rows)
    assert not bench.layer.attention.qkv.is_mkldnn  # the router's side stays as it was opened
    bench.experts_call(bench.layer_id, [(0, bench.hidden(2)), (1, bench.hidden(1))], repeats=1)
    assert runs[-1][1] == [2, 1]  # one Forward call's groups, one after another


def test_the_read_bandwidth_is_the_faster_of_torchs_sum_and_the_bfloat16_kernels_read(
    monkeypatch,
) -> None:
    read = []
    call = bf16.Panels.__call__
    monkeypatch.setattr(bf16.Panels, "__call__", lambda self, *a: read.append(1) or call(self, *a))
    rate = measure.read_bandwidth(nbytes=2**24, repeats=2)
    assert 1e8 < rate < 1e13  # bytes a second: between 0.1 GB/s and 10 TB/s
    assert len(read) == (3 if bf16.kernel("moe_linear") is not None else 0)


@pytest.mark.parametrize(
    ("l3s", "mib"),
    [
        ({"0-15": "307200K"}, 1280),  # the H200 host's 16-core Xeon: 300 MiB of L3, read at 4x
        ({"0-1": "32768K"}, 256),  # 32 MiB: the floor
        ({"0-1": "491520K"}, 2048),  # host C's 480 MiB: 4 x 480 = 1920, rounded up
        ({"0-63": "1048576K"}, 2048),  # 1 GiB: the ceiling
        ({"0-7": "96M"}, 512),  # rounded up to 256 MiB steps
        ({"0-7": "32M", "8-15": "32M", "16-23": "32M"}, 512),  # AMD: one L3 a core complex
        ({"0-1": ""}, 256),
        ({"0-1": "many"}, 256),
        ({}, 256),  # no caches in sysfs (some containers)
    ],
)
def test_the_read_buffer_is_four_times_the_l3s(tmp_path, l3s, mib) -> None:
    cpu = 0
    for shared, size in l3s.items():
        for _ in range(2):  # two CPUs of each instance: counted once
            for index, (level, text) in enumerate([("2", "2048K"), ("3", size)]):
                cache = tmp_path / f"cpu{cpu}" / "cache" / f"index{index + 2}"
                cache.mkdir(parents=True)
                (cache / "level").write_text(level + "\n")
                (cache / "size").write_text(text + "\n")
                (cache / "shared_cpu_list").write_text(
                    f"{shared}-{cpu}" if level == "2" else shared
                )
            cpu += 1
    assert measure.past_caches(tmp_path) == mib << 20
