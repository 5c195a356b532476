"""bench/mxfp4.py on a tiny gpt-oss: its baseline is the same model with the experts stored
dequantized, and its rows compare the two as bench/quantized.py's do."""

from __future__ import annotations

import json

import pytest
import torch

from bench import mxfp4 as bench
from common import bf16
from common.checkpoint import Checkpoint

pytestmark = pytest.mark.skipif(
    bf16.kernel("moe_linear") is None, reason="no C compiler or no AVX2: no MXFP4 kernels"
)


def test_mxfp4_experts_against_the_same_experts_dequantized(
    checkpoint, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(bench, "host_facts", lambda: {"cpu": "not measured here"})  # seconds
    path = tmp_path / "gpt-oss"
    path.symlink_to(checkpoint("gpt_oss", quantize="mxfp4"), target_is_directory=True)
    out = tmp_path / "mxfp4.json"
    argv = ["--checkpoint", str(path), "--out", str(out), "--batch-sizes", "2"]
    assert bench.main([*argv, "--new-tokens", "4", "--repeats", "1", "--no-products"]) == 0
    twin = tmp_path / "gpt-oss-dequantized"
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    pairs = Checkpoint(path).all_expert_pairs()
    for a, b in zip(
        Checkpoint(path, torch.float32).load_experts(pairs).values(),
        Checkpoint(twin, torch.float32).load_experts(pairs).values(),
    ):
        assert torch.equal(a.gate_up, b.gate_up) and torch.equal(a.down, b.down)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["precision"], r["batch"]) for r in rows] == [
        ("bfloat16", 2), ("mxfp4", 2)
    ]  # fmt: skip
    for dense, codes in zip(rows[::2], rows[1::2]):
        assert codes["bytes_per_token"] < dense["bytes_per_token"]
        assert codes["tokens_per_s"] > 0 and dense["vs_first"] == 1.0


def test_the_products_alone_are_timed_against_bfloat16(monkeypatch) -> None:
    monkeypatch.setattr(bench, "SHAPES", ((128, 64), (64, 96)))
    monkeypatch.setattr(bench, "EXPERTS", 2)
    rows = bench.products([1, 3], repeats=1, bandwidth=10e9)
    assert [(r["precision"], r["batch"]) for r in rows] == [
        ("mxfp4", 1), ("bfloat16", 1), ("mxfp4", 3), ("bfloat16", 3)
    ]  # fmt: skip
    sizes = {r["precision"]: r["bytes_per_expert"] for r in rows}
    assert sizes["bfloat16"] == 2 * (128 * 64 + 64 * 96)
    assert sizes["mxfp4"] == sizes["bfloat16"] * (0.5 + 2 / 32) / 2  # codes and block scales
    assert all(r["expert_ms"] > 0 for r in rows)
