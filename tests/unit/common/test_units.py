"""parse_size: byte sizes as people write them, and errors that say what is accepted."""

from __future__ import annotations

import pytest

from common.units import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1048576),
        ("0", 0),
        ("512MiB", 512 * 2**20),
        ("512mib", 512 * 2**20),  # units are case-insensitive
        ("2GB", 2 * 10**9),
        ("1.5KiB", 1536),
        ("10 kb", 10_000),
        (" 3B ", 3),
        ("1TiB", 2**40),
    ],
)
def test_sizes_with_and_without_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_a_percentage_is_a_share_of_the_whole_rounded_down() -> None:
    assert parse_size("25%", whole=1000) == 250
    assert parse_size("33.3%", whole=10) == 3
    assert parse_size("100%", whole=7) == 7
    assert parse_size("0%", whole=7) == 0


@pytest.mark.parametrize(
    ("text", "whole", "message"),
    [
        ("25 percent", None, "'25 percent' is not a size: use bytes (1048576), a unit"),
        ("-1MiB", None, "'-1MiB' is not a size"),
        ("MiB", None, "'MiB' is not a size"),
        ("", None, "'' is not a size"),
        ("1.2.3", None, "'1.2.3' is not a size"),
        ("5 parsecs", None, "'5 parsecs' is not a size"),
        ("25%", None, "'25%': a percentage needs a whole to be a share of"),
        ("101%", 100, "'101%': a percentage is at most 100%"),
    ],
)
def test_what_is_not_a_size_says_what_is_accepted(text: str, whole: int | None, message) -> None:
    with pytest.raises(ValueError) as e:
        parse_size(text, whole)
    assert str(e.value).startswith(message), str(e.value)
