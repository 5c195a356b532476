"""common/placement.py: expert specs name the (layer, expert) pairs of the grammar in its docstring,
'*' layers skip dense layers, a bad item is refused naming it, and format_experts writes a compact
spec that parses back to the same pairs."""

from __future__ import annotations

import random

import pytest

from common.errors import InvalidArgumentError
from common.placement import ModelShape, format_experts, parse_experts

SHAPE = ModelShape(num_layers=6, num_experts=8)
WITH_DENSE = ModelShape(num_layers=4, num_experts=4, layers=(1, 3))  # layers 0 and 2 dense


def test_the_grammar_names_these_pairs() -> None:
    assert parse_experts("0-1:0,1", SHAPE) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert parse_experts("*:7; 5:0-1", SHAPE) == [(i, 7) for i in range(5)] + [
        (5, 0),
        (5, 1),
        (5, 7),
    ]
    assert len(parse_experts("*:*", SHAPE)) == 6 * 8
    assert parse_experts(" 2 : 3 ;; ", SHAPE) == [(2, 3)]  # spaces and empty items
    assert parse_experts("*:0", WITH_DENSE) == [(1, 0), (3, 0)]  # '*' skips dense layers


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0-1", "is not LAYERS:EXPERTS"),
        ("0:x", "expert 'x' in '0:x' is not N or A-B"),
        ("6:0", r"layer '6' in '6:0' is outside \[0, 5\]"),
        ("0:3-1", "outside"),  # a range backwards
        ("0:8", r"outside \[0, 7\]"),
        (" ; ", "names no expert"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_item(text, message) -> None:
    with pytest.raises(InvalidArgumentError, match=f"experts: .*{message}"):
        parse_experts(text, SHAPE)


def test_a_dense_layer_named_explicitly_is_refused() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"layer 2 in '2:0' is a dense layer; MoE layers: \[1, 3\]"
    ):
        parse_experts("2:0", WITH_DENSE)


def test_format_groups_layers_serving_the_same_experts_and_parses_back() -> None:
    assert format_experts([(0, 0), (0, 1), (1, 0), (1, 1), (3, 5)]) == "0-1:0-1; 3:5"
    assert format_experts([(2, 3), (2, 1), (2, 2), (0, 7)]) == "0:7; 2:1-3"
    rng = random.Random(0)
    every = [(layer, e) for layer in range(6) for e in range(8)]
    for _ in range(50):
        pairs = sorted(rng.sample(every, rng.randint(1, len(every))))
        assert parse_experts(format_experts(pairs), SHAPE) == pairs
