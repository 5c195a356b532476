"""Packed experts (and a router's attention and LM head) in cache files: built once, mapped by
every load after, never used stale or corrupt."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import bf16, packcache, packed_experts
from common import linear as L
from common.checkpoint import Checkpoint
from common.moe import expert_ffn
from common.quant import Quantization, QuantPanels

pytestmark = pytest.mark.skipif(
    bf16.kernel("moe_linear") is None, reason="no C compiler or no AVX2: no bfloat16 panels"
)
PAIRS = [(0, 1), (2, 5)]


@pytest.fixture
def panels(monkeypatch, tmp_path):
    """A process that holds bfloat16 weights in panels, its packed files under tmp_path."""
    monkeypatch.setenv("MOE_MESH_PREPACK", "panels")
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MOE_MESH_PACK_CACHE", raising=False)
    L.panels.cache_clear()
    yield tmp_path / "cache" / "packed"
    L.panels.cache_clear()
    L.packed.cache_clear()  # forced for a router's dense float32 weights too: not for later tests


@pytest.fixture
def ckpt_dir(checkpoint, tmp_path):
    """A bfloat16 checkpoint of this test's own (its files' times are part of the cache key)."""
    return shutil.copytree(checkpoint("mixtral", dtype="bfloat16"), tmp_path / "ckpt")


def load(path, pairs=PAIRS):
    return Checkpoint(path, prepack=True, batch_invariant=True).load_experts(pairs)


def outputs(experts) -> list[torch.Tensor]:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    return [expert_ffn(x, w) for w in experts.values()]


def files(root) -> list:
    return sorted(root.glob("*/*.safetensors"))


def test_a_second_load_maps_the_files_the_first_packed_and_packs_nothing(
    panels, ckpt_dir, monkeypatch
):
    monkeypatch.setenv("MOE_MESH_PACK_CACHE", "off")
    private = load(ckpt_dir)
    monkeypatch.delenv("MOE_MESH_PACK_CACHE")
    first = load(ckpt_dir)
    assert [f.name for f in files(panels)] == [
        "layer0-expert1.safetensors",
        "layer2-expert5.safetensors",
    ]
    packed: list[tuple] = []
    monkeypatch.setattr(bf16, "pack", lambda w, out: packed.append(w.shape))
    second = load(ckpt_dir)
    assert packed == []  # mapped, not packed again
    for w in second.values():
        assert isinstance(w.gate_up, bf16.Panels) and isinstance(w.down, bf16.Panels)
        assert w.gate_up.shape == (192, 64) and w.down.shape == (64, 96)
    for a, b in zip(private.values(), second.values()):
        assert torch.equal(a.gate_up.data, b.gate_up.data) and torch.equal(a.down.data, b.down.data)
    assert all(torch.equal(a, b) for a, b in zip(outputs(private), outputs(first)))
    assert all(torch.equal(a, b) for a, b in zip(outputs(private), outputs(second)))


@pytest.mark.parametrize("source", ["bfloat16", "float32 opened in bfloat16"])
def test_packed_block_by_block_is_the_weight_packed_whole(
    panels, checkpoint, tmp_path, monkeypatch, source
):
    stored = "bfloat16" if source == "bfloat16" else "float32"
    path = shutil.copytree(checkpoint("mixtral", dtype=stored), tmp_path / "c")

    def experts():
        return Checkpoint(
            path, dtype=torch.bfloat16, prepack=True, batch_invariant=True
        ).load_experts(PAIRS)

    monkeypatch.setenv("MOE_MESH_PACK_CACHE", "off")
    whole = experts()
    monkeypatch.delenv("MOE_MESH_PACK_CACHE")
    monkeypatch.setattr(packed_experts, "COPY_BLOCK_BYTES", 32 * 64 * 4)  # 32 or 64 rows a block
    blocks = experts()
    assert len(files(panels)) == 2
    for a, b in zip(whole.values(), blocks.values()):
        assert torch.equal(a.gate_up.data, b.gate_up.data) and torch.equal(a.down.data, b.down.data)


def test_fused_experts_are_cached_too(panels, checkpoint, tmp_path):
    path = shutil.copytree(
        checkpoint("mixtral", dtype="bfloat16", expert_layout="fused"), tmp_path / "f"
    )
    expected = outputs(load(path))
    assert len(files(panels)) == 2
    assert all(torch.equal(a, b) for a, b in zip(expected, outputs(load(path))))


def test_a_routers_attention_and_lm_head_are_mapped_from_the_cache_too(
    panels, ckpt_dir, monkeypatch
):
    def dense():
        return Checkpoint(ckpt_dir, prepack=True).load_dense()  # a router's: not batch-invariant

    monkeypatch.setenv("MOE_MESH_PACK_CACHE", "off")
    private = dense()
    monkeypatch.delenv("MOE_MESH_PACK_CACHE")
    first = dense()
    layers = len(first.layers)
    assert len(files(panels)) == 2 * layers + 1  # qkv and o a layer, the LM head
    packed: list[tuple] = []
    monkeypatch.setattr(bf16, "pack", lambda w, out: packed.append(w.shape))
    second = dense()
    assert packed == []  # mapped, not packed again
    for a, b in [(private, second), (first, second)]:
        pairs = [(a.lm_head, b.lm_head)]
        pairs += [
            (getattr(x.attention, w), getattr(y.attention, w))
            for x, y in zip(a.layers, b.layers)
            for w in ("qkv", "o")
        ]
        for x, y in pairs:
            assert isinstance(y, bf16.Panels) and x.shape == y.shape
            assert torch.equal(x.data, y.data)


def test_dense_weights_computed_in_float32_or_quantized_write_no_file(panels, ckpt_dir):
    Checkpoint(ckpt_dir, dtype=torch.float32, prepack=True).load_dense()
    int8 = Quantization.parse("int8", 64)
    dense = Checkpoint(ckpt_dir, prepack=True, quantize=int8, quantize_dense=True).load_dense()
    assert isinstance(dense.layers[0].attention.qkv, QuantPanels)
    assert not panels.exists() or files(panels) == []


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "not safetensors"])
def test_a_corrupt_file_is_logged_rebuilt_and_never_used(panels, ckpt_dir, caplog, damage):
    expected = outputs(load(ckpt_dir))
    target = files(panels)[0]
    data = bytearray(target.read_bytes())
    if damage == "flipped byte":
        data[-100] ^= 0x40
    elif damage == "truncated":
        del data[len(data) // 2 :]
    else:
        data[:8] = b"\xff" * 8
    target.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="common.packcache"):
        again = load(ckpt_dir)
    assert f"packed-weight cache file {target} is corrupt" in caplog.text
    assert "rebuilding" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(expected, outputs(again)))
    caplog.clear()
    assert all(torch.equal(a, b) for a, b in zip(expected, outputs(load(ckpt_dir))))
    assert "corrupt" not in caplog.text  # rebuilt whole: the next load uses it


def test_a_file_built_from_another_version_of_the_checkpoint_is_stale_and_rebuilt(
    panels, ckpt_dir, caplog, monkeypatch
):
    load(ckpt_dir)
    built = {f: f.stat().st_mtime_ns for f in files(panels)}
    shard = next(ckpt_dir.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["model.layers.0.block_sparse_moe.experts.1.w1.weight"] *= 2
    save_file(tensors, shard, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="common.packcache"):
        changed = load(ckpt_dir)
    assert caplog.text.count("is stale") == 2
    assert all(f.stat().st_mtime_ns != t for f, t in built.items())  # both rebuilt
    monkeypatch.setenv("MOE_MESH_PACK_CACHE", "off")
    assert all(torch.equal(a, b) for a, b in zip(outputs(load(ckpt_dir)), outputs(changed)))


def test_an_unwritable_cache_keeps_the_weights_in_memory(panels, ckpt_dir, caplog, monkeypatch):
    panels.parent.mkdir(parents=True)
    panels.write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger="common.packcache"):
        experts = load(ckpt_dir)
    assert "weights kept in memory" in caplog.text
    monkeypatch.setenv("MOE_MESH_PACK_CACHE", "off")
    assert all(torch.equal(a, b) for a, b in zip(outputs(load(ckpt_dir)), outputs(experts)))


def test_float32_weights_and_a_cache_turned_off_write_no_file(
    panels, checkpoint, ckpt_dir, monkeypatch
):
    load(checkpoint("mixtral"))  # float32: used as stored (common/float32_rows.py)
    monkeypatch.setenv("MOE_MESH_PACK_CACHE", "off")
    load(ckpt_dir)
    assert not panels.exists() or files(panels) == []


def test_directories_of_checkpoints_that_are_gone_are_removed(panels, checkpoint, tmp_path):
    gone = shutil.copytree(checkpoint("mixtral", dtype="bfloat16"), tmp_path / "gone")
    load(gone, [(0, 0)])
    shutil.rmtree(gone)
    [old] = list(panels.iterdir())
    kept = shutil.copytree(checkpoint("mixtral", dtype="bfloat16"), tmp_path / "kept")
    load(kept, [(0, 0)])
    assert not old.exists()
    [new] = list(panels.iterdir())
    assert (new / "checkpoint").read_text() == str(kept.resolve())


def test_checksum_reads_a_tensors_bytes():
    t = torch.arange(6, dtype=torch.bfloat16)
    assert packcache.checksum(t) == packcache.checksum(t.clone())
    assert packcache.checksum(t) != packcache.checksum(t.flip(0))


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("on", True), ("off", False), ("0", False)]
)
def test_moe_mesh_pack_cache_turns_it_on_or_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("MOE_MESH_PACK_CACHE", raising=False)
    else:
        monkeypatch.setenv("MOE_MESH_PACK_CACHE", value)
    assert packcache.enabled() is on


def test_a_builder_that_died_leaves_no_file_behind_the_next_build(panels, ckpt_dir):
    load(ckpt_dir, [(0, 0)])
    [directory] = list(panels.iterdir())
    left = directory / "tmpx1y2.tmp"  # what a build killed mid-write leaves
    left.write_bytes(b"\0" * 4096)
    load(ckpt_dir, [(1, 0)])
    assert not left.exists()
    assert sorted(f.name for f in files(panels)) == [
        "layer0-expert0.safetensors",
        "layer1-expert0.safetensors",
    ]


def test_a_process_mapping_packed_files_may_hold_as_many_as_its_hard_limit(tmp_path) -> None:
    # A mapped file holds a descriptor; a large model's experts need thousands (soft limit: 1,024)
    script = (
        "import resource; from pathlib import Path; from common import packcache\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        f"packcache.PackCache(Path({str(tmp_path)!r}), 'key')\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard) or hard <= 256)\n"
    )
    env = {**os.environ, "MOE_MESH_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
