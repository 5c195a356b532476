"""bench.write_result: every bench's JSON names the CPU it ran on, as every figure is quoted."""

from __future__ import annotations

import json
from pathlib import Path

from bench import FLAGS, write_result


def test_a_result_names_the_hosts_cpu_model_and_flags(tmp_path) -> None:
    write_result(tmp_path / "r.json", {"figure": 1.0})
    result = json.loads((tmp_path / "r.json").read_text())
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(line for line in cpuinfo.splitlines() if line.startswith("model name"))
    assert result["figure"] == 1.0 and result["host_cpu"]["cpu"] == model.split(":", 1)[1].strip()
    flags = set(next(line for line in cpuinfo.splitlines() if line.startswith("flags")).split())
    assert result["host_cpu"]["flags"] == {f: f in flags for f in FLAGS}
