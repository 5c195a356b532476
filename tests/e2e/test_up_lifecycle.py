"""`moe-mesh up` cannot leak processes however it ends: SIGKILL, a closed stdout pipe, Ctrl-C during
start-up; bad flags are refused before anything starts. (Fixed gateway ports: test_up.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.support.cli import moe_mesh
from tests.support.net import bound_port


def start_up(path: Path, tmp_path: Path, *flags: str, stdout=None) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "mesh.json"
    log, err = open(tmp_path / "up.log", "w"), open(tmp_path / "up.err", "w")
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_mesh",
            "up",
            "--checkpoint",
            str(path),
            "--expert-services",
            "1",
            "--ready-file",
            str(ready),
            "--run-dir",
            str(tmp_path / "run"),
            *flags,
        ],
        stdout=stdout if stdout is not None else log,
        stderr=subprocess.STDOUT if stdout is None else err,
    )
    log.close()  # the child has its own copies
    err.close()
    return up, ready


def wait_ready(up: subprocess.Popen, ready: Path, tmp_path: Path) -> dict:
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert up.poll() is None, f"up exited {up.returncode}"
        assert time.monotonic() < deadline, "mesh not up in 120 s"
        time.sleep(0.1)
    return json.loads(ready.read_text())


def children_of(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def assert_all_gone(procs: list[psutil.Process], within_s: float = 5.0) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=within_s)
    try:
        assert not alive, f"still running {within_s:g}s later: {[p.pid for p in alive]}"
    finally:
        for p in alive:  # never leave them behind, even when the test fails
            p.kill()


def test_kill_9_of_up_takes_every_child_with_it(checkpoint, tmp_path) -> None:
    up, ready = start_up(checkpoint("mixtral"), tmp_path)
    try:
        mesh = wait_ready(up, ready, tmp_path)
        children = children_of(up.pid)
        # gateway, router, one expert service: each listed in the ready file by pid
        assert {c.pid for c in children} >= set(mesh["pids"].values())
        assert len(mesh["pids"]) == 3
        up.kill()  # no handler runs: only the kernel's parent-death signal can stop them
        up.wait(10)
        assert_all_gone(children)
    finally:
        if up.poll() is None:
            up.kill()


def test_a_closed_stdout_pipe_stops_up_and_every_child(checkpoint, tmp_path) -> None:
    read, write = os.pipe()
    up, ready = start_up(checkpoint("mixtral"), tmp_path, stdout=write)
    os.close(write)
    try:
        wait_ready(up, ready, tmp_path)
        children = children_of(up.pid)
        assert len(children) == 3
        os.close(read)  # `moe-mesh up | head -1` after head has exited
        assert up.wait(30) == 141, (tmp_path / "up.err").read_text()
        assert_all_gone(children)
        err = (tmp_path / "up.err").read_text()
        assert "Traceback" not in err and "stdout was closed" in err, err
    finally:
        if up.poll() is None:
            up.kill()


def test_ctrl_c_during_start_up_is_a_clean_130(checkpoint, tmp_path) -> None:
    up, ready = start_up(checkpoint("mixtral"), tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "run").glob("expert-*.log")):  # the first child is starting
            assert time.monotonic() < deadline and up.poll() is None
            time.sleep(0.05)
        children = children_of(up.pid)
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 130
        assert_all_gone(children)
        log = (tmp_path / "up.log").read_text()
        assert "exited with code" not in log and "error" not in log.lower(), log
        assert not ready.exists()
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--routers", "0"], "--routers"),
        (["--replicas", "0"], "--replicas"),
        (["--expert-services", "-1"], "--expert-services"),
        (["--colocate-budget", "lots"], "--colocate-budget"),
        (["--max-in-flight", "0"], "--max-in-flight"),
        (["--router-arg=--micro-batches banana"], "--micro-batches"),
        (["--http-port", "70000"], "--http-port"),
        (["--grpc-port", "45123", "--http-port", "45123"], "both 45123"),
        (["--device", "gpu"], "--device: "),
        (["--router-arg=--device tpu"], "device must be auto, cpu, cuda or cuda:N"),
        (["--expert-services", "0", "--expert-device", "cpu"], "--expert-device places"),
    ],
)
def test_bad_flags_are_refused_before_anything_starts(checkpoint, tmp_path, flags, words) -> None:
    run = tmp_path / "run"
    r = moe_mesh("up", "--checkpoint", checkpoint("mixtral"), "--run-dir", run, *flags)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(run.glob("*.log")), "a service was started"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda would start")
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--device", "cuda"], "--device: 'cuda' asked, but torch sees no CUDA device"),
        (["--device", "cpu", "--router-arg=--device=cuda"], "--router-arg: 'cuda' asked"),
        (["--expert-device", "cuda:1"], "--expert-device: 'cuda:1' asked"),
    ],
)
def test_a_gpu_torch_cannot_see_is_refused_before_anything_starts(
    checkpoint, tmp_path, flags, words
) -> None:
    run = tmp_path / "run"
    r = moe_mesh("up", "--checkpoint", checkpoint("mixtral"), "--run-dir", run, *flags)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert words in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not list(run.glob("*.log")), "a service was started"


def test_a_taken_gateway_port_is_refused_before_anything_starts(checkpoint, tmp_path) -> None:
    with bound_port(listen=True) as port:
        run = tmp_path / "run"
        r = moe_mesh(
            "up", "--checkpoint", checkpoint("mixtral"), "--run-dir", run, "--http-port", port
        )
    assert r.returncode == 1, (r.returncode, r.stderr)  # the exit-code table's row for a taken port
    assert f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not list(run.glob("*.log")), r.stderr


def test_a_broken_shape_checkpoint_exits_2_before_anything_starts(checkpoint, tmp_path) -> None:
    """A config.json that contradicts its weights is found in the headers: no service starts."""
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint("mixtral"), broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    run = tmp_path / "run"
    start = time.monotonic()
    r = moe_mesh("up", "--checkpoint", broken, "--run-dir", run, "--ready-file", run / "m.json")
    took = time.monotonic() - start
    assert r.returncode == 2, (r.returncode, r.stderr)  # the exit-code table's broken checkpoint
    err = r.stderr
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "tensor 'model.embed_tokens.weight'" in err and "hidden_size=32" in err, err
    assert "wrong shape [512, 64], config implies [512, 32]" in err, err
    assert not run.exists(), "the launcher ran: its run directory was made"
    # The interpreter, its imports and the headers (8 s on a loaded 2-core host), no service load
    assert took < 30, took
