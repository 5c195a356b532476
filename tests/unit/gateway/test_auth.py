"""API keys: parsed without ever echoing a key, compared by digest, limited per key (rate and
priority cap), and re-read when the file changes (a broken file keeps the keys in force)."""

from __future__ import annotations

import hashlib
import os

import pytest

from common.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from gateway.auth import ApiKeys, parse_keys

KEY_A, KEY_B = "sk-aaaaaaaaaaaa", "sk-bbbbbbbbbbbb"


def test_key_files_parse_and_bad_lines_never_echo_the_key() -> None:
    keys = parse_keys(f"# comment\n\n{KEY_A} name=a rpm=60 max_priority=2\n{KEY_B}\n", "f")
    assert [(k.name, k.rpm, k.max_priority) for k in keys] == [("a", 60, 2), ("key2", None, None)]
    for bad, message in [
        (f"{KEY_A} colour=blue", "unknown option"),
        ("short", "8\\+ characters"),
        (f"{KEY_A} rpm=many", "numbers"),
        (f"{KEY_A} rpm=0", "above 0"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            parse_keys(bad, "keys.txt")
        assert KEY_A not in str(info.value) and "line 1" in str(info.value)


def test_without_keys_everyone_is_admitted() -> None:
    keys = ApiKeys()
    assert not keys.enabled
    keys.authenticate(None).admit(priority=100)


def test_bearer_keys_from_the_environment_value() -> None:
    keys = ApiKeys(env_keys=f"{KEY_A},{KEY_B}")
    assert keys.authenticate(f"Bearer {KEY_B}").name == "key2"
    assert keys.authenticate(f"bearer  {KEY_A} ").name == "key1"
    for bad in [None, "", "Bearer", f"Basic {KEY_A}", "Bearer sk-wrong-key-123", KEY_A]:
        with pytest.raises(UnauthenticatedError):
            keys.authenticate(bad)
    # A bad one is refused at start-up like a bad key file, naming the variable and which key.
    with pytest.raises(InvalidArgumentError, match="MOE_GATEWAY_API_KEY: key 2: a key needs 8"):
        ApiKeys(env_keys=f"{KEY_A},short")


def test_rate_limit_and_priority_cap_per_key(tmp_path) -> None:
    now = [100.0]
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} name=a rpm=2 max_priority=0\n{KEY_B} name=b\n")
    keys = ApiKeys(path, clock=lambda: now[0])
    a = keys.authenticate(f"Bearer {KEY_A}")
    with pytest.raises(InvalidArgumentError, match="priority: at most 0 for this API key, got 5"):
        a.admit(5)
    a.admit(0)
    a.admit(-3)
    with pytest.raises(ResourceExhaustedError, match="'a'") as info:
        a.admit(0)
    assert info.value.retry_after_s == pytest.approx(30)
    now[0] += 30  # one minute's 2 requests: one comes back every 30 s
    a.admit(0)
    b = keys.authenticate(f"Bearer {KEY_B}")
    for _ in range(50):  # no limits on b
        b.admit(7)


def test_each_prompt_of_a_list_counts_against_the_keys_rate_all_or_none(tmp_path) -> None:
    now = [100.0]
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} name=a rpm=3\n")
    a = ApiKeys(path, clock=lambda: now[0]).authenticate(f"Bearer {KEY_A}")
    with pytest.raises(InvalidArgumentError, match="prompt: 4 prompts exceed the rate"):
        a.admit(None, 4)  # more than a minute's worth: no wait would grant it
    a.admit(None, 2)
    with pytest.raises(ResourceExhaustedError) as info:
        a.admit(None, 2)  # one left: none is taken
    assert info.value.retry_after_s == pytest.approx(20)
    a.admit(None, 1)
    now[0] += 40
    a.admit(None, 2)


def test_a_request_asking_no_priority_runs_at_its_keys_cap_when_that_is_below_0(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} name=batch max_priority=-10\n{KEY_B} name=b max_priority=5\n")
    keys = ApiKeys(path)
    batch, b = (keys.authenticate(f"Bearer {k}") for k in (KEY_A, KEY_B))
    assert (batch.admit(None), batch.admit(-20), b.admit(None), b.admit(3)) == (-10, -20, 0, 3)
    with pytest.raises(InvalidArgumentError, match="at most -10 for this API key, got 0"):
        batch.admit(0)  # asked for explicitly
    assert ApiKeys().authenticate(None).admit(None) == 0


def test_a_key_may_ask_for_exactly_its_cap_and_not_one_more(tmp_path) -> None:
    path = tmp_path / "keys"
    for cap in (-10, 0, 3):
        path.write_text(f"{KEY_A} max_priority={cap}\n")
        caller = ApiKeys(path).authenticate(f"Bearer {KEY_A}")
        assert caller.admit(cap) == cap
        with pytest.raises(InvalidArgumentError, match=f"at most {cap} for this API key"):
            caller.admit(cap + 1)


# Found by search: its SHA-256 digest starts with the same 3 bytes as KEY_A's (0986be...).
NEAR_A = "sk-near-20027543"


def test_a_key_whose_digest_matches_only_in_its_first_bytes_is_refused() -> None:
    near, real = (hashlib.sha256(k.encode()).digest() for k in (NEAR_A, KEY_A))
    assert near[:3] == real[:3] and near != real  # the premise of this test
    keys = ApiKeys(env_keys=KEY_A)
    with pytest.raises(UnauthenticatedError, match="incorrect API key"):
        keys.authenticate(f"Bearer {NEAR_A}")
    assert keys.authenticate(f"Bearer {KEY_A}").name == "key1"


def test_a_key_file_change_takes_effect_and_a_broken_one_keeps_the_keys(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n")
    keys = ApiKeys(path)
    keys.authenticate(f"Bearer {KEY_A}")
    path.write_text(f"{KEY_B} name=rotated\n")
    assert keys.authenticate(f"Bearer {KEY_B}").name == "rotated"
    with pytest.raises(UnauthenticatedError):
        keys.authenticate(f"Bearer {KEY_A}")  # revoked
    path.write_text("short\n")  # a mistake: the keys in force stay
    assert keys.authenticate(f"Bearer {KEY_B}").name == "rotated"
    os.unlink(path)
    assert keys.authenticate(f"Bearer {KEY_B}").name == "rotated"


def test_a_bad_key_file_at_start_up_is_an_error_naming_the_setting(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match="api_key_file"):
        ApiKeys(tmp_path / "absent")
    (tmp_path / "bad").write_text("x\n")
    with pytest.raises(InvalidArgumentError, match="line 1"):
        ApiKeys(tmp_path / "bad")
