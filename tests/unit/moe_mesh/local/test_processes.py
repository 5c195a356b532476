"""`running_up` against stand-in `up` commands (tiny Python scripts): ready, refused, stuck, deaf."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import psutil
import pytest

from common.errors import UnavailableError
from moe_mesh.local.processes import ServiceProcess, UpExited, running_up


def _script(body: str) -> tuple[str, ...]:
    """A stand-in for `python -m moe_mesh up`: argv as up gets it, --ready-file after --checkpoint."""
    prelude = (
        "import json, os, signal, sys, time\nready = sys.argv[sys.argv.index('--ready-file') + 1]\n"
    )
    return (sys.executable, "-c", prelude + body)


READY = textwrap.dedent(
    """
    child = os.fork()
    if child == 0:  # a service of the mesh: in up's process group, deaf to SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
        os._exit(0)
    with open(ready + ".tmp", "w") as f:
        json.dump({"pids": {"expert-0": child}, "argv": sys.argv[1:]}, f)
    os.replace(ready + ".tmp", ready)
"""
)


def test_yields_the_ready_file_and_stops_up_with_sigterm(tmp_path) -> None:
    up = _script(READY + "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\ntime.sleep(60)\n")
    with running_up(
        tmp_path / "ckpt", ["--routers", "2"], ready_file=tmp_path / "r.json",
        run_dir=tmp_path / "run", log_path=tmp_path / "up.log", command=up,
    ) as mesh:  # fmt: skip
        assert mesh.info["argv"] == [
            "--checkpoint", str(tmp_path / "ckpt"), "--ready-file", str(tmp_path / "r.json"),
            "--run-dir", str(tmp_path / "run"), "--routers", "2",
        ]  # fmt: skip
        assert mesh.proc.poll() is None
        child = mesh.pids["expert-0"]
    assert mesh.proc.returncode == 0  # it exited on SIGTERM, within the bound: no SIGKILL
    os.kill(child, 9)  # up's own job, which this stand-in does not do


def test_an_up_deaf_to_sigterm_is_killed_with_its_whole_group_after_the_bound(tmp_path) -> None:
    up = _script(READY + "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n")
    with running_up(
        tmp_path, (), ready_file=tmp_path / "r.json", run_dir=tmp_path,
        log_path=tmp_path / "up.log", stop_timeout_s=0.5, command=up,
    ) as mesh:  # fmt: skip
        child = psutil.Process(mesh.pids["expert-0"])
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    assert mesh.proc.returncode == -9
    # SIGKILLed with the group (it ignores SIGTERM): gone once its new parent reaps it
    _, alive = psutil.wait_procs([child], timeout=5)
    assert not alive


def test_an_up_that_refuses_its_flags_is_up_exited_with_its_code_and_log(tmp_path) -> None:
    up = _script("print('moe-mesh up: error: --routers must be >= 1'); sys.exit(2)\n")
    with pytest.raises(UpExited, match=r"exited with code 2 .*\n.*--routers must be >= 1") as e:
        with running_up(
            tmp_path, ["--routers", "0"], ready_file=tmp_path / "r.json", run_dir=tmp_path,
            log_path=tmp_path / "up.log", command=up,
        ):  # fmt: skip
            pytest.fail("yielded without a ready file")
    assert e.value.returncode == 2 and "--routers 0" in str(e.value)


def test_an_up_never_ready_is_unavailable_after_the_bound_and_stopped(tmp_path) -> None:
    up = _script("time.sleep(60)\n")
    with pytest.raises(UnavailableError, match=r"not serving after 0.3s") as e:
        with running_up(
            tmp_path, (), ready_file=tmp_path / "r.json", run_dir=tmp_path,
            log_path=tmp_path / "up.log", ready_timeout_s=0.3, stop_timeout_s=5, command=up,
        ):  # fmt: skip
            pytest.fail("yielded without a ready file")
    assert not isinstance(e.value, UpExited)


def test_a_stale_ready_file_is_not_taken_for_a_new_one(tmp_path) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"pids": {}}))
    up = _script("sys.exit(1)\n")
    with pytest.raises(UpExited, match="exited with code 1"):
        with running_up(
            tmp_path, (), ready_file=tmp_path / "r.json", run_dir=tmp_path,
            log_path=tmp_path / "up.log", command=up,
        ):  # fmt: skip
            pytest.fail("took the old ready file")


def test_a_service_process_does_not_take_a_previous_runs_ready_file(tmp_path) -> None:
    (tmp_path / "svc.ready.json").write_text(json.dumps({"address": "127.0.0.1:1"}))
    # A stand-in service (`python -m json.tool`): it fails at once and never writes a ready file.
    service = ServiceProcess("json.tool", ["--no-such-flag"], tmp_path, "svc")
    with pytest.raises(RuntimeError, match="svc exited with 2"):
        service.wait_ready(timeout_s=30)
    service.stop()
