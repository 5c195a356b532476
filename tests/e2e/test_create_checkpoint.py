"""The `small` preset (hidden 1024, 8 layers): created at full size, sharded, with skewed routers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_mesh.dev.create_checkpoint import create_checkpoint
from tests.support.hf import top2_share_per_layer


@pytest.mark.slow
def test_small_preset(tmp_path: Path) -> None:
    path = create_checkpoint(
        tmp_path / "small", "qwen3_moe", "small", router_skew=4.0, max_shard_size="400MB"
    )
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_experts"]) == (
        1024,
        8,
        8,
    )
    assert config["vocab_size"] >= 4096
    assert len(list(path.glob("*.safetensors"))) > 1
    shares = top2_share_per_layer(path)
    assert min(shares) > 0.5 and sum(shares) / len(shares) > 0.6
