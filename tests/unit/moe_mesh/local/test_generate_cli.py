"""`moe-mesh generate`'s sampling flags: one per SamplingParams field, defaulted as the field is."""

from __future__ import annotations

import argparse
import dataclasses

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
