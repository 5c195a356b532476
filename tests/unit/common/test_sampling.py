"""SamplingParams: every field's limit and its error, the proto converters over every field, and
the dataclass and the protos naming the same fields."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest

from common.errors import InvalidArgumentError
from common.sampling import MAX_LOGPROBS, Range, SamplingParams, from_proto, to_proto
from protos.moe_mesh.v1 import inference_pb2, router_pb2

OK = SamplingParams(max_tokens=8)

# (field, a value past its limit, the error's message after the field's name)
BAD = [
    ("max_tokens", 0, "must be >= 1, got 0"),
    ("temperature", -0.5, "must be >= 0, got -0.5"),
    ("temperature", math.inf, "must be >= 0, got inf"),
    ("temperature", math.nan, "must be >= 0, got nan"),
    ("top_p", 0.0, "must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "must be in (0, 1], got 1.5"),
    ("top_k", -1, "must be in [0, 2^31), got -1"),
    ("top_k", 2**31, f"must be in [0, 2^31), got {2**31}"),
    ("min_p", -0.1, "must be in [0, 1], got -0.1"),
    ("min_p", 1.5, "must be in [0, 1], got 1.5"),
    ("min_p", math.nan, "must be in [0, 1], got nan"),
    ("seed", -1, "must be in [0, 2^64), got -1"),
    ("seed", 2**64, f"must be in [0, 2^64), got {2**64}"),
    ("presence_penalty", 2.5, "must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -2.5, "must be in [-2, 2], got -2.5"),
    ("repetition_penalty", 0.0, "must be > 0, got 0.0"),
    ("repetition_penalty", math.inf, "must be > 0, got inf"),
    ("min_tokens", 9, "must be in [0, max_tokens=8], got 9"),
    ("min_tokens", -1, "must be in [0, max_tokens=8], got -1"),
    ("logprobs", MAX_LOGPROBS + 1, "must be in [0, 20], got 21"),
    ("logprobs", -1, "must be in [0, 20], got -1"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD)
def test_a_value_past_its_limit_names_the_field_and_the_limit(name, value, message) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        replace(OK, **{name: value}).validate()
    assert e.value.field == name and str(e.value) == f"{name}: {message}"


# (field, the values at its limits, which pass)
EDGES = [
    ("max_tokens", [1, 10**9]),
    ("temperature", [0.0, 1e6]),
    ("top_p", [1e-9, 1.0]),
    ("top_k", [0, 2**31 - 1]),
    ("min_p", [0.0, 1.0]),
    ("seed", [None, 0, 2**64 - 1]),
    ("presence_penalty", [-2.0, 2.0]),
    ("frequency_penalty", [-2.0, 2.0]),
    ("repetition_penalty", [1e-9, 1e9]),
    ("min_tokens", [0, 8]),
    ("logprobs", [None, 0, MAX_LOGPROBS]),
]


@pytest.mark.parametrize(("name", "values"), EDGES)
def test_values_at_the_limits_pass(name, values) -> None:
    for value in values:
        params = replace(OK, **{name: value})
        assert params.validate() is params


def test_every_bounded_field_has_a_bad_value_and_its_edges_tested() -> None:
    bounded = {f.name for f in fields(SamplingParams) if "range" in f.metadata}
    assert bounded <= {name for name, _, _ in BAD} and bounded <= {name for name, _ in EDGES}


def test_limits_that_depend_on_the_server() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^max_tokens: must be in \[1, 100\], got 101$"):
        replace(OK, max_tokens=101).validate(max_tokens_limit=100)
    assert replace(OK, max_tokens=100).validate(max_tokens_limit=100).max_tokens == 100
    with pytest.raises(InvalidArgumentError) as e:
        replace(OK, stop_token_ids=(3, 50)).validate(vocab_size=50)
    assert str(e.value) == "stop_token_ids: token id 50 is outside the vocabulary [0, 50)"
    with pytest.raises(InvalidArgumentError, match="token id -1 is outside"):
        replace(OK, stop_token_ids=(-1,)).validate(vocab_size=50)
    assert replace(OK, stop_token_ids=(0, 49)).validate(vocab_size=50).stop_token_ids == (0, 49)
    with pytest.raises(InvalidArgumentError, match="^max_tokens: must be set$"):
        SamplingParams(max_tokens=None).validate()


def test_errors_use_the_apis_name_for_a_field() -> None:
    names = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
    with pytest.raises(InvalidArgumentError) as e:
        replace(OK, max_tokens=0).validate(names=names)
    assert e.value.field == "max_completion_tokens"
    assert str(e.value) == "max_completion_tokens: must be >= 1, got 0"
    with pytest.raises(InvalidArgumentError) as e:
        replace(OK, logprobs=21).validate(names=names)
    assert e.value.field == "top_logprobs"
    with pytest.raises(InvalidArgumentError) as e:
        replace(OK, top_p=2.0).validate(names=names)
    assert e.value.field == "top_p"


def test_range_reads_as_its_interval() -> None:
    assert str(Range(0, 1)) == "in [0, 1]"
    assert str(Range(0, 1, low_open=True)) == "in (0, 1]"
    assert str(Range(0, 2**31, high_open=True)) == "in [0, 2^31)"
    assert str(Range(0, 4096)) == "in [0, 4096]"
    assert str(Range(0)) == ">= 0" and str(Range(0, low_open=True)) == "> 0"
    assert 10**400 not in Range(0, 2**64) and 10**400 in Range(0)  # no float overflow


# A value unlike the default in every field, each exact in the proto's types (float32).
EVERY = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_p=0.75,
    top_k=3,
    min_p=0.25,
    seed=2**64 - 1,
    stop_token_ids=(4, 9),
    ignore_eos=True,
    presence_penalty=-1.5,
    frequency_penalty=1.25,
    repetition_penalty=1.5,
    min_tokens=2,
    logprobs=5,
)


def test_the_sample_differs_from_the_default_in_every_field() -> None:
    default = SamplingParams()
    assert [
        f.name for f in fields(SamplingParams) if getattr(EVERY, f.name) == getattr(default, f.name)
    ] == []


def test_every_field_survives_the_router_proto() -> None:
    message = to_proto(EVERY, router_pb2.SamplingParams())
    wire = router_pb2.SamplingParams.FromString(message.SerializeToString())
    assert from_proto(wire) == EVERY


def test_unset_optional_fields_keep_the_base() -> None:
    default = SamplingParams()
    message = to_proto(default, router_pb2.SamplingParams())
    assert not message.HasField("seed") and not message.HasField("logprobs")
    assert from_proto(message) == default
    base = SamplingParams(max_tokens=None, seed=3)
    assert from_proto(inference_pb2.GenerateRequest(), base, logprobs=None) == base


def test_the_public_request_carries_every_field_by_name() -> None:
    """The public API spells logprobs as a flag plus top_logprobs: the caller gives that one."""
    request = inference_pb2.GenerateRequest()
    for f in fields(SamplingParams):
        if f.name != "logprobs":
            value = getattr(EVERY, f.name)
            if isinstance(value, tuple):
                getattr(request, f.name).extend(value)
            else:
                setattr(request, f.name, value)
    wire = inference_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert from_proto(wire, logprobs=EVERY.logprobs) == EVERY


def test_the_dataclass_and_the_protos_name_the_same_fields() -> None:
    """A knob added to one and not the others fails here."""
    ours = {f.name: f for f in fields(SamplingParams)}
    router = router_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    public = inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    assert set(router) == set(ours)
    assert set(ours) <= set(public)
    # None ("not given") must travel: such a field needs presence in the router's message.
    for name, f in ours.items():
        if f.default is None:
            assert router[name].has_presence, name
