"""Selective loading really saves memory: resident memory of dense-only and one-expert loads of the
`small` preset against a full load, each measured in a fresh process after touching every loaded byte."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MEASURE = r"""
import dataclasses, json, sys
import psutil, torch
from common.checkpoint import Checkpoint

def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors(x)

proc = psutil.Process()
ckpt = Checkpoint(sys.argv[1])
before = proc.memory_info().rss
mode = sys.argv[2]
loaded = []
if mode in ("dense", "full"):
    loaded.append(ckpt.load_dense())
if mode == "one_expert":
    loaded.append(ckpt.load_experts([(0, 0)]))
if mode == "full":
    loaded.append(ckpt.load_experts(ckpt.all_expert_pairs()))
ts = {t.data_ptr(): t for t in tensors(loaded)}.values()  # tied embeddings count once
checksum = sum(float(t.sum()) for t in ts)  # touch every page
print(json.dumps({"rss_bytes": proc.memory_info().rss - before, "weight_bytes": sum(t.nbytes for t in ts)}))
"""


def _measure(path, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), mode], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


@pytest.mark.slow
def test_subset_loads_use_a_fraction_of_a_full_load(checkpoint) -> None:
    path = checkpoint("mixtral", preset="small")
    full, dense, one = (_measure(path, m) for m in ("full", "dense", "one_expert"))
    print(
        f"\nRSS growth: full {full['rss_bytes'] / 2**20:.0f} MiB, dense-only {dense['rss_bytes'] / 2**20:.0f} MiB, "
        f"one expert {one['rss_bytes'] / 2**20:.1f} MiB (weights {one['weight_bytes'] / 2**20:.1f} MiB)"
    )
    assert (
        full["rss_bytes"] >= 0.9 * full["weight_bytes"]
    )  # the measurement sees what a full load touches
    assert dense["rss_bytes"] < 0.3 * full["rss_bytes"]
    assert one["rss_bytes"] < 0.05 * full["rss_bytes"]
    assert one["rss_bytes"] < dense["rss_bytes"]
