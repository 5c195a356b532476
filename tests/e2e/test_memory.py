"""Selective loading really saves memory: resident memory of dense-only and one-expert loads of the
`small` preset against a full load, each measured in a fresh process after touching every loaded byte.
And an expert service holds one copy of its weights: its peak is its weights plus the import floor
plus a bounded margin, and replicas share the weights they use as stored (bench/memory.py measures).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from common import bf16
from moe_mesh.local.processes import start_experts, stop_all

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


# 2 layers of 8 experts, each 3 × 1024 × 1024 float32 (12 MiB): 192 MiB, far above the noise.
WIDE = {"hidden_size": 1024, "moe_intermediate_size": 1024, "num_hidden_layers": 2}
WIDE_WEIGHTS_MIB = 2 * 8 * 12


@pytest.mark.slow
@pytest.mark.parametrize("prepack", ["auto", "off", "panels", "on"])
def test_expert_services_hold_one_copy_of_their_weights(
    checkpoint, tmp_path, monkeypatch, prepack
) -> None:
    """Two replicas of every expert, their weights touched by a call: each peaks within the
    margin over weights + import floor. Used as stored (prepack off; Qwen stores gate and up back
    to back, and float32 experts by default, read as stored by moe-mesh's batch-invariant kernel)
    their checkpoint pages count once between them; so do bfloat16 experts in moe-mesh's panels,
    packed once into cache files both map (common/packcache.py)."""
    from bench.memory import MARGIN_MIB, import_floor, memory, touch

    if prepack == "panels" and bf16.kernel("moe_linear") is None:
        pytest.skip("no C compiler or no AVX2: no bfloat16 panels")
    path = checkpoint("qwen3_moe", overrides=WIDE)
    floor = import_floor("off")
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path / "cache"))  # here too: memory() reads it
    env = {"MOE_MESH_CACHE_DIR": str(tmp_path / "cache")}
    if prepack != "auto":
        env["MOE_MESH_PREPACK"] = prepack
    dtype = "bfloat16" if prepack == "panels" else "float32"
    args = ["--fast-path", "off", "--dtype", dtype]
    procs = start_experts(path, ["*:*", "*:*"], tmp_path, *args, env=env)
    try:
        assert [touch(p.address) for p in procs] == [(dtype, 16)] * 2
        rows = [memory(p.proc.pid, path) for p in procs]
    finally:
        stop_all(procs)
    weights = WIDE_WEIGHTS_MIB * getattr(torch, dtype).itemsize / 4
    print(f"\nimport floor {floor['rss_mib']:.0f} MiB; replicas (prepack {prepack}): {rows}")
    for row in rows:
        assert row["peak_rss_mib"] <= weights + floor["rss_mib"] + MARGIN_MIB, row
    shared = sum(row["pss_checkpoint_mib"] for row in rows)
    # float32 experts are used as stored where moe-mesh's kernel runs (common/linear.py);
    # `on`, or no kernel: in oneDNN's layout, a copy each, where oneDNN has float32
    copies = prepack == "on" or (prepack == "auto" and bf16.kernel("moe_f32_linear") is None)
    if copies and torch.backends.mkldnn.is_available():
        assert shared < 0.1 * weights  # the file pages the copies were made from are gone
    else:
        assert 0.9 * weights <= shared <= 1.05 * weights
        for row in rows:  # no private copy beside the shared pages
            assert row["pss_anon_mib"] < floor["anon_mib"] + 0.5 * weights, row
