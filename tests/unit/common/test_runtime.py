"""OpenMP wait defaults: a lone process spins briefly, processes sharing cores sleep at once,
whatever the user set wins, and a thread that loaded can hand its cores over."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common import runtime


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


RELEASE = """
import os, torch
from common import runtime
torch.set_num_threads(2)
def threads(): return len(os.listdir('/proc/self/task'))
x = torch.empty(4_000_000)
alone = threads()
x.fill_(1)  # a parallel op: this thread's team of OpenMP workers starts
with_team = threads()
runtime.release_openmp_threads(serial=True)
released = threads()
x.add_(1)  # serial now: no team again
print(alone, with_team, released, threads(), torch.get_num_threads())
"""


def test_a_thread_releases_its_openmp_workers_and_stays_serial() -> None:
    # In a child: the test process's own OpenMP state is left alone.
    out = subprocess.run(
        [sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    alone, with_team, released, after, threads = map(int, out)
    assert with_team == alone + 1
    assert released == alone and after == alone
    assert threads == 1
