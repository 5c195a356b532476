"""bench/gpu_host_cpu.py (gpu_check's part f): the runs it plans from the host's cores, the CPU
facts it records, and a run that fails or overruns recorded while the next one runs."""

from __future__ import annotations

import subprocess

from bench import gpu_host_cpu
from bench.gpu_support import Context


def test_many_cores_add_a_run_on_four_threads() -> None:
    slice_, small = gpu_host_cpu.GEOMETRIES
    assert gpu_host_cpu.runs(16) == [(slice_, 16), (small, 16), (slice_, 4)]
    assert gpu_host_cpu.runs(2) == [(slice_, 2), (small, 2)]


def test_the_cpu_facts_name_the_model_and_the_cores() -> None:
    facts = gpu_host_cpu.cpu_facts()
    assert facts["cores"] >= 1 and facts["model"]
    assert set(facts["flags"]) <= set(gpu_host_cpu.FLAGS)


def test_a_failed_run_is_recorded_and_the_next_runs(tmp_path, monkeypatch) -> None:
    def rates(ctx, name, threads):
        if name == "small":
            raise subprocess.CalledProcessError(1, "bench.quantized")
        return {"rows": {"bfloat16": {"vs_first": 1.0}, "int8-all": {"vs_first": 1.9}}}

    monkeypatch.setattr(gpu_host_cpu, "rates", rates)
    monkeypatch.setattr(gpu_host_cpu, "cpu_facts", lambda: {"cores": 16})
    monkeypatch.setattr(gpu_host_cpu, "phases", lambda ctx, threads: {})  # tested on its own
    ctx = Context("cpu", tmp_path, float("inf"), tmp_path / "part-f.json")
    result = gpu_host_cpu.host_cpu(ctx)
    assert "CalledProcessError" in result["small, 16 threads"]["error"]
    assert result["summary"] == "qwen3 x16: int8-all 1.90x; qwen3 x4: int8-all 1.90x"
    assert result["ok"] is True
    assert (tmp_path / "part-f.json").exists()  # written as it grew


def test_a_run_past_the_time_left_keeps_the_rows_it_printed(tmp_path, monkeypatch) -> None:
    printed = "loading bfloat16 ...\nbatch   1  bfloat16:   93.3 tok/s  1.00x bfloat16\n"

    def run(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"], output=printed)

    monkeypatch.setattr(gpu_host_cpu.subprocess, "run", run)
    ctx = Context("cpu", tmp_path, float("inf"))
    (tmp_path / gpu_host_cpu.SMALL).mkdir()
    row = gpu_host_cpu.rates(ctx, "small", 4)
    assert row == {"timed_out": True, "printed": [printed.splitlines()[1]]}


def test_phases_profile_small_first_and_a_failure_leaves_the_slice_to_run(
    tmp_path, monkeypatch
) -> None:
    calls = []

    def child(ctx, module, geometry, path, threads, flags):
        calls.append((geometry, path.name, threads))
        if geometry == "small":
            raise RuntimeError("bench.step_phases exited 1")
        return {"rows": [{"precision": "bfloat16"}]}

    monkeypatch.setattr(gpu_host_cpu, "child", child)
    monkeypatch.setattr(gpu_host_cpu, "make_slice", lambda ctx, name, layers: (tmp_path / name,))
    out = gpu_host_cpu.phases(Context("cpu", tmp_path, float("inf")), 16)
    slice_, small = gpu_host_cpu.GEOMETRIES
    assert calls == [(small, gpu_host_cpu.SMALL, 16), (slice_, slice_, 16)]
    assert "exited 1" in out[small]["error"]
    assert out[slice_] == {"threads": 16, "rows": [{"precision": "bfloat16"}]}
