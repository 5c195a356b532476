"""`up` hands the gateway's flags to the gateway process as the gateway's own CLI spells them."""

from __future__ import annotations

import argparse

import pytest
import torch

from gateway import cli as gateway_cli
from moe_mesh.local.cli import (
    GATEWAY_FLAGS,
    _devices_problem,
    _expert_device,
    _pass_through,
    _settings,
    add_subcommands,
)
from moe_mesh.local.settings import UpSettings
from router_service import cli as router_cli


def _up(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    return parser.parse_args(["up", "--checkpoint", "ckpt", *argv])


def test_given_flags_pass_through_and_booleans_take_no_value() -> None:
    args = _up("--allow-unknown-fields", "--no-disable-fastapi-docs", "--max-prompts", "8")
    passed = _pass_through(args, GATEWAY_FLAGS)
    assert passed == ["--max-prompts", "8", "--allow-unknown-fields", "--no-disable-fastapi-docs"]
    assert _pass_through(_up(), GATEWAY_FLAGS) == []  # unset: the gateway's defaults hold


def test_the_gateway_parses_what_up_passes() -> None:
    passed = _pass_through(_up("--allow-unknown-fields", "--max-prompts", "8"), GATEWAY_FLAGS)
    parser = argparse.ArgumentParser()
    gateway_cli.add_arguments(parser)
    parsed = parser.parse_args(["--checkpoint", "ckpt", *passed])
    assert parsed.allow_unknown_fields is True and parsed.max_prompts == 8


def _devices(*argv: str, router_device: str | None = None) -> str | None:
    """What `up` says of the devices its flags name (None: nothing wrong)."""
    args = _settings(UpSettings, _up(*argv), ["checkpoint"], "up")
    return _devices_problem(args, router_device or args.device)


def test_the_experts_device_is_expert_device_else_device() -> None:
    for argv, want in [
        ((), "auto"),
        (("--device", "cpu"), "cpu"),
        (("--device", "cuda", "--expert-device", "cpu"), "cpu"),
        (("--device", "cpu", "--expert-device", "cuda:1"), "cuda:1"),
        (("--quantize", "int8"), "cpu"),  # auto: quantized experts compute on CPUs only
        (("--quantize", "int8", "--device", "cuda", "--expert-device", "cpu"), "cpu"),
    ]:
        assert _expert_device(_settings(UpSettings, _up(*argv), ["checkpoint"], "up")) == want


def test_quantized_experts_on_a_gpu_are_refused_naming_the_flag_that_put_them_there() -> None:
    problem = _devices("--quantize", "int8", "--expert-device", "cuda")
    assert problem == "--quantize int8: quantized experts compute on CPUs only, and " + (
        "--expert-device puts them on cuda"
    )
    problem = _devices("--quantize", "int4", "--expert-services", "0", router_device="cuda:0")
    assert problem is not None and "--router-arg puts them on cuda:0" in problem
    assert _devices("--quantize", "int8", "--device", "cuda", "--expert-device", "cpu") in (
        None,  # a GPU host
        "--device: 'cuda' asked, but torch sees no CUDA device here "
        f"(torch {torch.__version__}, built for CUDA none); use cpu or auto",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda is there")
def test_each_gpu_flag_is_checked_and_named() -> None:
    assert _devices("--device", "cpu") is None and _devices() is None
    assert _devices("--device", "cuda").startswith("--device: 'cuda' asked")
    assert _devices("--expert-device", "cuda:0").startswith("--expert-device: 'cuda:0' asked")
    assert _devices(router_device="cuda").startswith("--router-arg: 'cuda' asked")
    # with no expert service, --expert-device places nothing (up refuses it on its own)
    assert _devices("--expert-services", "0", "--expert-device", "cuda") is None


def test_a_router_arg_device_is_later_than_up_s_and_wins() -> None:
    """`up` passes --device to the routers before --router-arg's words (moe_mesh/local/cli.py)."""
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    parsed = parser.parse_args(["--checkpoint", "c", "--device", "cpu", "--device=cuda"])
    assert parsed.device == "cuda"


def test_quantized_experts_are_refused_before_any_process_starts_where_they_cannot_run(
    checkpoint, monkeypatch
) -> None:
    from moe_mesh.local.cli import _check_flags

    float32 = checkpoint("mixtral")  # the demo's dtype
    args = _up("--quantize", "int4")
    args.checkpoint = float32
    assert "checkpoint create --dtype bfloat16" in _check_flags(args, [])
    args.checkpoint = checkpoint("mixtral", dtype="bfloat16")
    monkeypatch.setenv("MOE_MESH_MAX_ISA", "none")
    assert _check_flags(args, []) == (
        "--quantize int4: quantized experts need the C kernels (MOE_MESH_MAX_ISA=none)"
    )
