"""bench/memory.py's readings of /proc: a process's memory, and the share of it that is a
checkpoint's mapped pages."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from bench.memory import memory, status_kib
from common import packcache
from common.safetensors_mmap import SafetensorsFile

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def test_status_fields_in_kib() -> None:
    text = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t1024 kB\nThreads:\t4\n"
    assert status_kib(text) == {"VmHWM": 2048, "VmRSS": 1024}


def test_a_mapped_checkpoint_counts_as_its_pages(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.ones(1 << 20)}, ckpt / "model.safetensors")  # 4 MiB
    before = memory(os.getpid(), ckpt)
    f = SafetensorsFile(ckpt / "model.safetensors")
    assert float(f.get("w").sum()) == 1 << 20  # every page read
    after = memory(os.getpid(), ckpt)
    assert before["pss_checkpoint_mib"] == 0
    assert 3.9 <= after["pss_checkpoint_mib"] <= 4.1  # no other process maps it
    assert after["peak_rss_mib"] >= after["rss_mib"] >= after["pss_mib"] > 0


def test_its_packed_weight_files_count_too(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    packed = packcache.directory(ckpt)
    packed.mkdir(parents=True)
    save_file({"w": torch.ones(1 << 19)}, packed / "layer0-expert0.safetensors")  # 2 MiB
    f = SafetensorsFile(packed / "layer0-expert0.safetensors")
    assert float(f.get("w").sum()) == 1 << 19
    assert 1.9 <= memory(os.getpid(), ckpt)["pss_checkpoint_mib"] <= 2.1
    other = tmp_path / "other"
    other.mkdir()
    assert memory(os.getpid(), other)["pss_checkpoint_mib"] == 0  # another checkpoint's are not
