"""OpenMP wait defaults: a lone process spins briefly, processes sharing cores sleep at once,
whatever the user set wins, and a thread that loaded can hand its cores over. A loaded service's
heap is frozen; exit_now keeps what was written and the exit code."""

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


TRIM = """
from common import runtime
def anon(): return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon'))
blocks = [bytearray(65536) for _ in range(2_500)]  # 160 MiB, below glibc's mmap threshold
del blocks[::2]  # freed between live ones: holes glibc keeps
before = anon()
runtime.return_freed_heap()
print(before, anon())
"""


def test_the_heap_freed_between_live_blocks_goes_back_to_the_system() -> None:
    before, after = map(int, _child(TRIM).stdout.split())
    assert before - after > 60 * 1024, (before, after)  # kB: most of the 80 MiB freed


def _child(code: str) -> subprocess.CompletedProcess:
    """`code` in a child: the test process's collector and exit are left alone."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_freeze_heap_exempts_what_is_alive_and_collects_garbage_first() -> None:
    done = _child(
        "import gc\nfrom common import runtime\n"
        "a = []; a.append(a); del a\n"  # a cycle: garbage only a collection frees
        "kept = [[i] for i in range(1000)]\n"
        "runtime.freeze_heap()\n"
        "print(gc.get_freeze_count(), gc.collect())"
    )
    frozen, found = map(int, done.stdout.split())
    assert frozen > 1000 and found == 0, done.stderr


@pytest.mark.parametrize("code", [0, 3, None])
def test_exit_now_flushes_stdio_and_logging_and_keeps_the_code(code, tmp_path) -> None:
    log = tmp_path / "service.log"
    done = _child(
        "import logging, sys\nfrom common import runtime\n"
        f"logging.basicConfig(filename={str(log)!r})\n"
        "logging.getLogger('x').warning('logged')\n"
        "sys.stdout.write('unflushed out'); sys.stderr.write('unflushed err')\n"
        f"runtime.exit_now({code})\n"
        "print('not reached')"
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        code or 0,
        "unflushed out",
        "unflushed err",
    )
    assert "logged" in log.read_text()


def test_exit_now_with_its_reader_gone_still_exits_with_the_code() -> None:
    done = _child(
        "import os, sys\nfrom common import runtime\n"
        "r, w = os.pipe(); os.close(r)\n"
        "sys.stdout = os.fdopen(w, 'w')\n"  # buffered, its reader gone: flushing it fails
        "sys.stdout.write('x')\n"
        "runtime.exit_now(5)"
    )
    assert done.returncode == 5 and "Error" not in done.stderr, done.stderr
