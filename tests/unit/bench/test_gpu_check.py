"""bench/gpu_check.py: `--dry-run` reports its plumbing in seconds on a host without a GPU (the
wheels found and missing, every part's plan and command lines, torch's CUDA status), and a part
that fails, crashes or overruns its bound is recorded, with what it measured so far, while the
check goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import PARTS, Part, Settings, run_child, run_part, table
from bench.gpu_wheels import ROOT, WHEELS

DRY_RUN_BOUND_S = 60  # measured: 5-8 s on AMD EPYC, 2 shared cores


def dry_run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(tmp_path / "out")]
    cmd += ["--work-dir", str(tmp_path / "work"), *flags]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=DRY_RUN_BOUND_S)
    assert time.monotonic() - started < DRY_RUN_BOUND_S
    assert done.returncode == 0, done.stderr
    return done, json.loads((tmp_path / "out" / "gpu_check_dry_run.json").read_text())


def test_dry_run_reports_wheels_plans_and_commands(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in WHEELS[1:]:  # all but the first
        with zipfile.ZipFile(wheels / f"{name.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
            z.writestr("x/METADATA", "")
    done, report = dry_run(tmp_path, "--wheels-dir", str(wheels))
    assert report["dry_run"] is True and set(report["parts"]) == set(PARTS)
    assert report["wheels"] == {
        "folder": str(wheels),
        "present": True,
        "missing": [WHEELS[0]],
        "ucx": False,
    }
    assert set(report["cuda"]) >= {"torch", "cuda_build", "cuda_available"}
    assert f"missing: {WHEELS[0]};" in done.stdout and "torch: {" in done.stdout
    for key, plan in report["parts"].items():
        child = plan["commands"][0]
        assert child[-2:] == ["--part-json", str(tmp_path / "work" / f"part-{key}.json")]
        assert child[1:5] == ["-m", "bench.gpu_check", "--parts", key]
        assert f"part {key}: {plan['title']}" in done.stdout
    assert (
        report["parts"]["a"]["families"][0] == "mixtral"
        and len(report["parts"]["a"]["families"]) == 8
    )
    up = [" ".join(c) for c in report["parts"]["b"]["commands"][1:]]
    assert up == ["moe-mesh up --checkpoint CHECKPOINT --expert-services 2 --device cuda"]
    flags = report["parts"]["d"]["up_flags"]
    assert ["--expert-services", "2", "--device", "cuda", "--expert-device", "cpu"] in flags
    assert ["--expert-services", "2", "--device", "cuda", "--router-arg=--fast-path=off"] in flags
    assert "tests/unit/router_service/engine/test_gpu.py" in report["parts"]["e"]["files"]
    # `up` and the router take every flag the plans give them.
    assert [p for plan in report["parts"].values() for p in plan["problems"]] == []


def test_dry_run_without_the_wheels_says_how_to_get_them(tmp_path) -> None:
    done, report = dry_run(tmp_path, "--wheels-dir", str(tmp_path / "none"), "--parts", "a,c")
    assert report["wheels"]["present"] is False and report["wheels"]["missing"] == list(WHEELS)
    assert "make gpu-wheels" in done.stdout
    assert set(report["parts"]) == {"a", "c"}


def test_an_unknown_part_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown part"):
        gpu_check.selected(Settings(parts="a,z"))


def test_a_part_that_raises_is_recorded_as_failed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOE_GPU_CHECK_BOUND_S", "5")
    out = tmp_path / "part.json"
    args = Settings(device="cpu", work_dir=tmp_path, part_json=out)
    run_child(args, Part("x", "math.sqrt of a context", 5, "math", "sqrt"))
    result = json.loads(out.read_text())
    assert result["status"] == "failed" and result["error"].startswith("TypeError")


@pytest.mark.parametrize(
    ("script", "status"),
    [
        ("import sys; sys.exit(3)", "crashed (exit 3)"),
        ("import time; time.sleep(30)", "timed out after 2 s"),
    ],
)
def test_run_part_bounds_and_records_a_child(tmp_path, monkeypatch, script, status) -> None:
    args = Settings(device="cpu", work_dir=tmp_path)
    partial = json.dumps({"measured": 1})
    code = f"open({str(tmp_path / 'part-a.json')!r}, 'w').write({partial!r}); {script}"
    monkeypatch.setattr(gpu_check, "child_command", lambda *_: [sys.executable, "-c", code])
    started = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        result = run_part(args, PARTS["a"], 2.0, log)
    assert time.monotonic() - started < 10
    assert result["status"] == status and result["measured"] == 1  # what it measured is kept
    assert status.split()[0] in table({"a": result})


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for a reaper that is not us."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("then", ["time.sleep(30)", "time.sleep(1.5); sys.exit(3)"])
def test_what_a_part_left_running_is_ended(tmp_path, monkeypatch, then) -> None:
    """A mesh runs as a session of its own (moe_mesh/local/processes.py): a part killed at its
    bound, or one that crashed, must not leave it holding the GPU for the next part."""
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); {then}"
    )
    monkeypatch.setattr(gpu_check, "child_command", lambda *_: [sys.executable, "-c", code])
    with open(tmp_path / "log", "w") as log:
        run_part(Settings(device="cpu", work_dir=tmp_path), PARTS["d"], 3.0, log)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)
