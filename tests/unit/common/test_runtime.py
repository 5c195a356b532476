"""OpenMP wait defaults: a lone process spins briefly, processes sharing cores sleep at once,
and whatever the user set wins."""

from __future__ import annotations

import os

import pytest

from moe_mesh.common import runtime


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(runtime, "_spin_defaulted", False)


def test_a_lone_process_spins_briefly_and_its_children_sleep(clean_env) -> None:
    runtime.configure()
    assert os.environ["GOMP_SPINCOUNT"] == runtime.SHORT_SPIN
    assert "OMP_WAIT_POLICY" not in os.environ
    child = runtime.shared_cores_env(dict(os.environ))
    assert child["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in child


def test_processes_sharing_cores_sleep_at_once(clean_env) -> None:
    runtime.configure(shares_cores=True)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.parametrize("var,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "500")])
def test_what_the_user_set_wins_here_and_in_children(
    clean_env, monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    runtime.configure()
    runtime.configure(shares_cores=True)
    assert (
        os.environ[var] == value
        and len({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ)) == 1
    )
    assert runtime.shared_cores_env(dict(os.environ))[var] == value
