"""`--setup NAME=FLAGS`: what a set-up is made of, and what is refused before anything starts."""

from __future__ import annotations

import pytest

from common.errors import InvalidArgumentError
from moe_mesh.benchmark.setups import Setup, parse_setup


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("monolithic=--expert-services 0", Setup("monolithic", ("--expert-services", "0"))),
        ("plain=", Setup("plain", ())),
        (
            "grpc=--expert-services 4 --router-arg='--fast-path off'",
            Setup("grpc", ("--expert-services", "4", "--router-arg=--fast-path off")),
        ),
        (
            "mb-2.x=--router-arg=--micro-batches=2",
            Setup("mb-2.x", ("--router-arg=--micro-batches=2",)),
        ),
    ],
)
def test_a_set_up_is_a_name_and_up_flags_split_like_a_shell(text, want) -> None:
    assert parse_setup(text) == want


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("--expert-services 0", "expected NAME=FLAGS"),
        ("=--expert-services 0", "expected NAME=FLAGS"),
        ("a b=--routers 2", "expected NAME=FLAGS"),
        ("a=--router-arg='--fast-path", "a: No closing quotation"),
        ("a=--ready-file x.json", "a: --ready-file is set by the benchmark"),
        ("a=--checkpoint=/ckpt", "a: --checkpoint=/ckpt is set by the benchmark"),
    ],
)
def test_a_bad_set_up_is_refused_naming_the_flag(text, message) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^--setup: {message}"):
        parse_setup(text)
