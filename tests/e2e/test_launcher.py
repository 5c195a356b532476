"""The launcher's failure paths and `scale`, driven directly: children that fail, hang, ignore SIGTERM,
a dying gateway, and scale operations that race."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from common.placement import format_experts, parse_experts
from moe_mesh.local.launcher import Launcher
from moe_mesh.local.scaling import OnlyCopyError
from tests.support.polling import wait_until

SLEEPER = ["-c", "import time; time.sleep(60)"]
DEAF = [
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
    "time.sleep(60)",
]


@pytest.fixture
def launcher(checkpoint, tmp_path):
    made: list[Launcher] = []

    def make(**kwargs) -> Launcher:
        made.append(
            Launcher(
                checkpoint("mixtral"),
                tmp_path / "run",
                1,
                1,
                1,
                [],
                [],
                ready_file=tmp_path / "mesh.json",
                **kwargs,
            )
        )
        return made[-1]

    yield make
    for launcher in made:
        launcher.stop()


def test_the_paths_a_ready_file_names_are_absolute(checkpoint, tmp_path, monkeypatch) -> None:
    # `up --run-dir run --tls-dir certs` from one directory, `status` or `traces` from another
    monkeypatch.chdir(tmp_path)
    ckpt = checkpoint("mixtral")
    relative = Path(os.path.relpath(ckpt, tmp_path))
    mesh = Launcher(relative, Path("run"), 1, 1, 1, [], [], tls_dir=Path("certs"))
    assert mesh.checkpoint == ckpt and mesh.run_dir == tmp_path / "run"
    assert mesh.tls_dir == tmp_path / "certs"
    mesh.stop()


def test_a_child_failing_at_start_is_reported_with_its_exit_code_and_log(launcher) -> None:
    mesh = launcher()
    child = mesh._spawn(
        "expert", "broken", ["-c", "import sys; print('cannot load shard 3'); sys.exit(3)"]
    )
    with pytest.raises(
        RuntimeError, match=r"broken .* exited with code 3 while starting:\n.*cannot load shard 3"
    ):
        mesh._wait_ready([child])


def test_a_child_that_never_gets_ready_times_out_naming_it(launcher) -> None:
    mesh = launcher(ready_timeout_s=0.5)
    child = mesh._spawn("router", "stuck", SLEEPER)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not ready after 0.5s: stuck \(pid \d+"):
        mesh._wait_ready([child])
    assert time.monotonic() - start < 5
    assert child.proc.poll() is None  # still there: stop() ends it


def test_stop_kills_a_child_that_ignores_sigterm_after_the_timeout(launcher, capfd) -> None:
    mesh = launcher(stop_timeout_s=0.5)
    child = mesh._spawn("gateway", "deaf", DEAF)
    deadline = time.monotonic() + 30
    while "up" not in child.log_path.read_text():  # its SIGTERM handler is in place
        assert time.monotonic() < deadline
        time.sleep(0.05)
    start = time.monotonic()
    mesh.stop()
    assert child.proc.returncode == -9 and time.monotonic() - start < 5
    assert "did not stop in 0.5s; killing it" in capfd.readouterr().err


def test_watch_stops_when_the_gateway_dies_and_the_ready_file_drops_dead_experts(
    launcher, capfd
) -> None:
    mesh = launcher()
    expert = mesh._spawn("expert", "expert-1", ["-c", "import time; time.sleep(0.5)"])
    expert.info = {"address": "127.0.0.1:1", "experts": "*:0-7"}
    mesh._spawn("router", "router-0", SLEEPER)
    mesh._spawn("gateway", "gateway", ["-c", "import time; time.sleep(1.5)"])
    mesh.publish()
    assert [e["address"] for e in json.loads(mesh.ready_file.read_text())["experts"]] == [
        "127.0.0.1:1"
    ]
    start = time.monotonic()
    mesh.watch([False])  # returns by itself: no gateway, no mesh
    assert time.monotonic() - start < 10
    err = capfd.readouterr().err
    assert (
        "expert expert-1" in err
        and "gateway gateway" in err
        and "the mesh cannot serve any more" in err
    )
    assert json.loads(mesh.ready_file.read_text())["experts"] == []


def _serving(mesh: Launcher, group: str) -> list[dict]:
    want = format_experts(parse_experts(group, mesh.spec))
    return [e for e in json.loads(mesh.ready_file.read_text())["experts"] if e["experts"] == want]


def test_scale_is_serialized_idempotent_followed_by_the_ready_file_and_reaches_zero_forced(
    launcher,
) -> None:
    mesh = launcher()
    mesh.start_control_plane()
    mesh.publish()
    group = "*:0-1"
    replies: dict[int, dict] = {}

    def scale(n: int) -> None:
        replies[n] = mesh.scale(group, n)

    # Two scales of one group race: the later one (1) must win, not be counted against stale state.
    first = threading.Thread(target=scale, args=(3,))
    first.start()
    wait_until(mesh._scale_lock.locked, 10, "the first scale to start")  # then the second queues
    second = threading.Thread(target=scale, args=(1,))
    second.start()
    first.join(120)
    second.join(120)
    assert len(replies[3]["added"]) == 3 and len(replies[1]["removed"]) == 2
    [kept] = _serving(mesh, group)
    assert kept["address"] not in replies[1]["removed"]

    again = mesh.scale(group, 1)  # the same request twice changes nothing
    assert (again["added"], again["removed"]) == ([], [])
    assert _serving(mesh, group) == [kept]

    # The group is the only copy of its experts (no router colocates them here): refused, naming
    # them, until forced.
    with pytest.raises(OnlyCopyError, match=r"experts 0-2:0-1 would have no replica left") as e:
        mesh.scale(group, 0)
    assert e.value.missing == "0-2:0-1" and _serving(mesh, group) == [kept]
    gone = mesh.scale(group, 0, force=True)
    assert gone["removed"] == [kept["address"]] and _serving(mesh, group) == []
    assert all(c.proc.poll() is not None for c in mesh.children)


def test_the_ready_file_drops_a_router_that_died(launcher, tmp_path) -> None:
    mesh = launcher()
    a, b = (mesh._spawn("router", name, SLEEPER) for name in ("router-0", "router-1"))
    for i, c in enumerate((a, b)):
        c.info = {"address": f"127.0.0.1:{5000 + i}", "metrics": f"127.0.0.1:{6000 + i}"}
    mesh.endpoints = {"routers": ["127.0.0.1:5000", "127.0.0.1:5001"], "metrics": {}}
    b.proc.kill()
    b.proc.wait()
    mesh.publish()
    ready = json.loads((tmp_path / "mesh.json").read_text())
    assert ready["routers"] == ["127.0.0.1:5000"]
    assert ready["metrics"]["routers"] == ["127.0.0.1:6000"]
    assert set(ready["pids"]) == {"router-0"}
