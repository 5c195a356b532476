"""`moe-mesh generate`'s sampling flags: one per SamplingParams field, defaulted as the field is."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from common.sampling import SamplingParams
from moe_mesh.local.generate_cli import add_sampling_arguments, sampling_from_args


def _parse(*argv: str) -> SamplingParams:
    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser)
    return sampling_from_args(parser.parse_args(argv))


def test_no_flags_give_the_default_params_and_every_field_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == {f.name for f in dataclasses.fields(SamplingParams)}
    assert _parse() == SamplingParams()


def test_flags_set_their_fields_with_the_fields_types() -> None:
    params = _parse(
        "--max-tokens", "7", "--temperature", "0", "--top-k", "3", "--min-p", "0.25",
        "--seed", "11", "--stop-token-ids", "5,6", "--ignore-eos", "--logprobs", "2",
        "--repetition-penalty", "1.5",
    )  # fmt: skip
    assert params == SamplingParams(
        max_tokens=7, temperature=0.0, top_k=3, min_p=0.25, seed=11, stop_token_ids=(5, 6),
        ignore_eos=True, logprobs=2, repetition_penalty=1.5,
    )  # fmt: skip


def _generate_local(checkpoint, capsys, *argv: str) -> tuple[int, str, str]:
    from moe_mesh.cli import main

    code = main(
        ["generate", "--local", "--checkpoint", str(checkpoint("mixtral")), "--json"]
        + ["--prompt-token-ids", "1,2,3", "--max-tokens", "2", "--temperature", "0", *argv]
    )
    out = capsys.readouterr()
    return code, out.out, out.err


def test_local_generation_on_device_cpu_is_generation_as_before(checkpoint, capsys) -> None:
    code, out, _ = _generate_local(checkpoint, capsys, "--device", "cpu")
    assert code == 0
    code, before, _ = _generate_local(checkpoint, capsys)
    assert code == 0
    if not torch.cuda.is_available():  # auto is the CPU: the same tokens
        assert json.loads(out)["token_ids"] == json.loads(before)["token_ids"]
    assert len(json.loads(out)["token_ids"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda would generate")
def test_local_generation_on_a_gpu_torch_cannot_see_exits_2_naming_device(
    checkpoint, capsys
) -> None:
    code, _, err = _generate_local(checkpoint, capsys, "--device", "cuda")
    assert code == 2 and "device: 'cuda' asked, but torch sees no CUDA device" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
