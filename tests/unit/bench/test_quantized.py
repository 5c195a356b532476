"""bench/quantized.py, as every CPU bench (bench/__init__.py's parse_settings), computes on the CPU
on a GPU host too: `auto` there put its bfloat16 engine on the GPU and its int8 and int4 engines on
the CPU, and the ratios compared the two."""

from __future__ import annotations

import os

import pytest

from bench import CPU_ONLY, parse_settings, quantized
from bench.gpu_check import Settings as GpuCheck
from moe_mesh.local.settings import GenerateSettings, UpSettings
from router_service.settings import RouterSettings


@pytest.fixture
def cuda_env(monkeypatch):
    for name in CPU_ONLY:  # as an operator's GPU host might have them; restored after
        monkeypatch.setenv(name, "cuda")


def test_a_cpu_bench_puts_router_experts_up_and_generate_on_the_cpu(cuda_env, tmp_path) -> None:
    parse_settings(quantized.Settings, None, [])
    assert {os.environ[name] for name in CPU_ONLY} == {"cpu"}  # children inherit them
    assert RouterSettings(checkpoint=tmp_path).device == "cpu"
    up = UpSettings(checkpoint=tmp_path)
    assert up.device == up.expert_device == "cpu"
    assert GenerateSettings().device == "cpu"


def test_the_gpu_check_leaves_devices_to_its_parts(cuda_env) -> None:
    parse_settings(GpuCheck, None, ["--dry-run"])
    assert {os.environ[name] for name in CPU_ONLY} == {"cuda"}
