"""`moe-mesh serve-expert` configuration errors: exit 2 with one line naming the problem."""

from __future__ import annotations

import pytest
import torch

from expert_service import cli
from tests.support.experts import ARCH


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--experts", "0:9"], "experts: expert '9' in '0:9' is outside [0, 7]"),
        (["--experts", "nonsense"], "experts: item 'nonsense' is not LAYERS:EXPERTS"),
        (
            ["--max-batch-tokens", "0"],
            "--max-batch-tokens: Input should be greater than or equal to 1",
        ),
    ],
)
def test_cli_bad_configuration_exits_2_with_one_line(checkpoint, capsys, args, message) -> None:
    assert cli.main(["--checkpoint", str(checkpoint(ARCH)), *args]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("moe-mesh serve-expert: error: ") and message in err and err.count("\n") == 1
    ), err


def test_cli_broken_checkpoint_exits_2_naming_the_file(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("moe-mesh serve-expert: error: ")
        and "config.json" in err
        and err.count("\n") == 1
    ), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda would serve")
def test_cli_device_cuda_without_a_gpu_exits_2_naming_device(checkpoint, capsys) -> None:
    assert cli.main(["--checkpoint", str(checkpoint(ARCH)), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-mesh serve-expert: error: device: 'cuda' asked, but torch sees no")
    assert err.count("\n") == 1, err


def test_cli_device_not_a_device_exits_2_naming_the_choices(checkpoint, capsys) -> None:
    assert cli.main(["--checkpoint", str(checkpoint(ARCH)), "--device", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "--device: " in err and "auto, cpu, cuda or cuda:N" in err and err.count("\n") == 1, err
