"""moe_mesh/local/checks.py: what `up` checks before it starts a process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from moe_mesh.local.checks import checkpoint_problem, device_problem, exposure


def test_a_correct_checkpoint_has_no_problem(checkpoint) -> None:
    assert checkpoint_problem(checkpoint("mixtral")) is None


def test_a_broken_one_is_one_line_naming_flag_tensor_and_field(checkpoint, tmp_path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint("mixtral"), broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_attention_heads": 8}))
    problem = checkpoint_problem(broken)
    assert problem is not None and problem.startswith("--checkpoint: wrong shape [64, 64]")
    assert "tensor 'model.layers.0.self_attn.o_proj.weight'" in problem, problem
    assert "num_attention_heads=8" in problem and "\n" not in problem


def test_the_gateway_exposure_follows_up_s_flags(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("MOE_GATEWAY_API_KEY", raising=False)
    assert exposure(None, tls=False, api_key_file=None) is None  # the default host: loopback
    assert "TLS" in exposure("0.0.0.0", tls=False, api_key_file=tmp_path / "keys")
    assert "API keys" in exposure("0.0.0.0", tls=True, api_key_file=None)
    monkeypatch.setenv("MOE_GATEWAY_API_KEY", "k")
    assert exposure("0.0.0.0", tls=True, api_key_file=None) is None


def test_cpu_and_auto_pass_without_importing_torch() -> None:
    """`up` on the CPU stays quick to start: torch is imported only where a GPU is named."""
    code = (
        "import sys\n"
        "from moe_mesh.local.checks import device_problem\n"
        "assert device_problem('--device', 'cpu') is None\n"
        "assert device_problem('--device', 'auto') is None\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda is there")
@pytest.mark.parametrize(("flag", "device"), [("--device", "cuda"), ("--expert-device", "cuda:1")])
def test_a_gpu_torch_cannot_see_is_one_line_naming_the_flag(flag, device) -> None:
    problem = device_problem(flag, device)
    assert problem is not None and problem.startswith(
        f"{flag}: '{device}' asked, but torch sees no"
    )
    assert "\n" not in problem
