"""bench/step_phases.py: on the kernels' phase-timing build, a decode token's time phase by phase,
the split of a KV head's query heads showing as its own phase where the threads outnumber the KV
heads, and a clear exit where the kernels are not that build."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import step_phases
from bench.gpu_wheels import ROOT


def run(path, out, threads: int) -> dict:
    cmd = [sys.executable, "-m", "bench.step_phases", "--checkpoint", str(path), "--out", str(out)]
    cmd += ["--precisions", "bfloat16,int4-all", "--group-size", "32", "--new-tokens", "65"]
    done = subprocess.run(
        [*cmd, "--threads", str(threads)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bfloat16:" in done.stdout and "int4-all:" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("threads", [2, 8])
def test_a_token_is_timed_phase_by_phase(checkpoint, tmp_path, threads) -> None:
    # tiny Qwen3-MoE: 2 KV heads of 2 query heads each; one token, so 8 threads split them in
    # bfloat16, not in int4, whose single heads of 16 columns would split o's groups of 32
    result = run(checkpoint("qwen3_moe"), tmp_path / "phases.json", threads)
    assert result["threads"] == threads
    for row in result["rows"]:
        phases = row["phases_us"]
        assert list(phases) == list(step_phases.PHASES)
        assert all(phases[p] > 0 for p in ("qkv", "attention", "gate up", "down", "lm head"))
        assert (phases["kv prepare"] > 0) == (threads == 8 and row["precision"] == "bfloat16")
        # Long bursts leave little but the step, so on a busy host the decode's wall time can come
        # out a little under the step's own timers.
        assert 0 < row["products_us"] + row["between_us"] <= 1.25 * row["decode_us"]


def test_the_usual_build_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(step_phases.bf16, "library", lambda: object())  # no phase timers
    with pytest.raises(SystemExit, match="not the phase-timing build"):
        step_phases.timers()
