"""The compute timings `moe-mesh profile` takes, on a tiny checkpoint: the router's and experts'
own code runs, times are positive, load shares are shares."""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import Checkpoint
from moe_mesh.planning.measure import LayerBench, timed


@pytest.fixture(scope="module")
def bench(checkpoint) -> LayerBench:
    return LayerBench(Checkpoint(checkpoint("qwen2_moe"), dtype=torch.float32))


def test_timings_are_positive_for_every_side(bench: LayerBench) -> None:
    for b in (1, 5):
        for t in (
            bench.router_layer(b, context=16, repeats=2),
            bench.expert_layer(b, repeats=2),
            bench.head(b, repeats=2),
        ):
            assert t.wall_s > 0 and t.cpu_s > 0
    pair = (bench.layer_id, 0)
    assert bench.expert_call(pair, bench.hidden(3), repeats=2).wall_s > 0


def test_dense_layers_are_timed_only_when_the_model_has_them(bench: LayerBench) -> None:
    dense = bench.dense_layer(2, context=8, repeats=1)
    assert (dense is None) == all(bench.spec.moe_layers)


def test_load_shares_sum_to_one_per_moe_layer(bench: LayerBench) -> None:
    shares = bench.load_shares(256)
    assert sorted(shares) == bench.spec.moe_layer_ids
    for row in shares.values():
        assert len(row) == bench.spec.num_experts and sum(row) == pytest.approx(1.0)


def test_timed_reports_median_wall_and_cpu_per_run() -> None:
    calls = []
    t = timed(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7 and 0 <= t.wall_s < 0.01 and t.cpu_s >= 0


def test_a_latent_attention_model_with_dense_layers_is_timed(checkpoint) -> None:
    path = checkpoint("deepseek_v3", overrides={"first_k_dense_replace": 1})
    bench = LayerBench(Checkpoint(path, dtype=torch.float32))
    assert bench.layer_id == 1
    for t in (
        bench.router_layer(3, context=16, repeats=1),
        bench.dense_layer(3, context=16, repeats=1),
        bench.expert_layer(3, repeats=1),
    ):
        assert t.wall_s > 0
    shares = bench.load_shares(64)
    assert sorted(shares) == [1, 2] and sum(shares[1]) == pytest.approx(1.0)


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN kernels"
)
def test_expert_timings_use_the_layout_expert_services_hold(checkpoint) -> None:
    path = checkpoint("qwen2_moe")
    service = Checkpoint(path, dtype=torch.float32, prepack=True, batch_invariant=True)
    bench = LayerBench(Checkpoint(path, dtype=torch.float32), experts=service)
    served = service.load_experts([(bench.layer_id, 0)])[(bench.layer_id, 0)]
    assert bench.experts[0].gate_up.is_mkldnn == served.gate_up.is_mkldnn == True  # noqa: E712
    assert not bench.layer.attention.qkv.is_mkldnn  # the router's side stays as it was opened
    assert bench.experts_call(bench.layer_id, [(0, bench.hidden(2))], repeats=1).wall_s > 0
