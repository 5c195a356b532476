"""ExpertHost: what one expert service loads, and which activations it takes."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch

from common import bf16
from common.errors import InvalidArgumentError
from common.placement import parse_experts
from common.telemetry import Telemetry
from common.weights import FFNWeights
from expert_service.core import ExpertHost
from expert_service.settings import ExpertSettings
from tests.support.experts import SPEC, assert_close, reference
from tests.support.fp8 import fp8_checkpoint
from tests.support.metrics import scrape


def test_host_loads_only_its_experts(settings) -> None:
    for spec in (SPEC, "2:7; 0:5"):
        host = ExpertHost.load(settings(experts=spec))
        assert sorted(host.weights) == parse_experts(spec, host.spec)
        assert all(isinstance(w, FFNWeights) for w in host.weights.values())


@pytest.mark.parametrize(
    "arch, created, served, name",
    [
        ("mixtral", {"dtype": "bfloat16"}, {"quantize": "int8"}, "int8"),
        pytest.param(  # as published: computed from its codes
            *("gpt_oss", {"quantize": "mxfp4"}, {"dtype": "bfloat16"}, "mxfp4"),
            marks=pytest.mark.skipif(
                bf16.kernel("moe_linear") is None, reason="no C compiler or AVX2: dequantized"
            ),
        ),
    ],
)
def test_the_weights_held_are_a_metric_named_by_their_precision(
    arch, created, served, name, checkpoint, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path))
    telemetry = Telemetry.create("expert", metrics_port=0)
    try:
        host = ExpertHost.load(
            # the CPU's precisions (a GPU holds FP8 and MXFP4 experts dequantized)
            ExpertSettings(
                checkpoint=checkpoint(arch, **created), experts=SPEC, device="cpu", **served
            ),
            telemetry,
        )
        assert host.describe().precision == name
        held = sum(w.nbytes for w in host.weights.values())
        samples = scrape(telemetry)
        assert samples[f"moe_expert_weight_bytes{{moe_precision={name}}}"] == held
    finally:
        telemetry.shutdown()


@pytest.mark.skipif(bf16.kernel("moe_linear") is None, reason="no C compiler or AVX2: dequantized")
def test_an_fp8_checkpoints_experts_are_reported_as_fp8(checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path))
    path = fp8_checkpoint(checkpoint("deepseek_v3", dtype="bfloat16"), tmp_path / "fp8")
    host = ExpertHost.load(ExpertSettings(checkpoint=path, experts="1:0-3", device="cpu"))
    assert host.describe().precision == "fp8"  # computed from its e4m3 bytes, not bfloat16


async def test_large_finite_activations_pass_and_any_nan_or_inf_is_counted(settings) -> None:
    host = ExpertHost.load(settings(experts="0:0"))
    h = host.spec.hidden_size

    def forward(hidden):
        return host.forward(host.model_id, host.weights_checksum, 0, [0], [2], hidden)

    # Their sum overflows to inf: still finite activations, so the call is served.
    out = await forward(torch.full((2, h), 3e38))
    assert out.shape == (2, h)
    for bad in (float("nan"), float("inf"), -float("inf")):
        hidden = torch.zeros(2, h)
        hidden[1, 3] = hidden[0, 0] = bad
        with pytest.raises(InvalidArgumentError, match="holds 2 non-finite value"):
            await forward(hidden)
    await host.close()


# In a fresh process: one that freed a large block earlier (another test) may serve the
# temporary from that resident hole, and the measurement would see nothing come or go.
FREED_WHILE_LOADING = r"""
import json
from pathlib import Path
import torch
from expert_service.core import large_frees_returned

def anon_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

with large_frees_returned():
    pinned = torch.ones(1 << 18)  # 1 MiB kept: below the temporary, as a packed weight is
    before = anon_mib()
    temporary = torch.ones(4 << 20)  # 16 MiB, every page touched
    during = anon_mib()
    del temporary
    after = anon_mib()
print(json.dumps([before, during, after, float(pinned.sum())]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc and /proc")
def test_a_temporary_freed_while_loading_leaves_the_process() -> None:
    """What loading frees (gate and up joined, then repacked) must not stay resident."""
    out = subprocess.run(
        [sys.executable, "-c", FREED_WHILE_LOADING], check=True, capture_output=True, text=True
    )
    before, during, after, kept = json.loads(out.stdout.strip().splitlines()[-1])
    assert during - before >= 15 and after - before < 2, (before, during, after)
    assert kept == 1 << 18


async def test_device_cpu_serves_as_before(settings) -> None:
    auto, cpu = ExpertHost.load(settings()), ExpertHost.load(settings(device="cpu"))
    assert cpu.device == torch.device("cpu") and cpu.describe().device == "cpu"
    assert cpu.batcher._stager.identity  # nothing staged: the wire's tensors are computed on
    rows = torch.randn(3, cpu.spec.hidden_size)
    outs = [await h.forward(h.model_id, h.weights_checksum, 0, [1], [3], rows) for h in (auto, cpu)]
    if auto.device.type == "cpu":  # auto is the CPU where torch sees no GPU
        assert torch.equal(outs[0], outs[1])
    assert_close([outs[1]], reference(cpu.settings.checkpoint, 0, [(1, rows)]))
    await auto.close()
    await cpu.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda would load")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_asked_for_where_torch_sees_none_is_refused_before_loading(settings, device) -> None:
    with pytest.raises(
        InvalidArgumentError, match=rf"^device: '{device}' asked, but torch sees no"
    ):
        ExpertHost.load(settings(device=device))


def test_a_gpu_index_beyond_the_hosts_is_refused(settings) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^device: 'cuda:99' asked, but"):
        ExpertHost.load(settings(device="cuda:99"))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: experts loaded onto a GPU"
)
async def test_on_a_gpu_experts_compute_there_and_answer_in_host_memory(settings) -> None:
    host = ExpertHost.load(settings(device="cuda"))
    assert all(w.down.is_cuda for w in host.weights.values())
    assert host.describe().device == "cuda:0"
    rows = torch.randn(4, host.spec.hidden_size)
    out = await host.forward(host.model_id, host.weights_checksum, 0, [1], [4], rows)
    assert out.device.type == "cpu"
    assert_close([out], reference(host.settings.checkpoint, 0, [(1, rows)]), atol=1e-4)
    await host.close()
