"""Part e of bench/gpu_check.py: the suite's tests that need a CUDA device, run on one. Each is
skipped where torch sees none, so CI never runs them; the first GPU run found a bug one of them
would have caught. pytest runs the files that hold them, in a process of its own, and its summary
comes back with every test it skipped for want of a device (none should be on a GPU)."""

from __future__ import annotations

import re
import subprocess
import sys

from bench.gpu_support import Context

# The files whose tests ask for a CUDA device (`skipif(not torch.cuda.is_available())`); their
# other tests run too (seconds), next to them as on a CPU.
FILES = (
    "tests/unit/router_service/engine/test_gpu.py",
    "tests/unit/expert_service/test_core.py",
    "tests/unit/common/test_staging.py",
    "tests/unit/common/test_device.py",
)
NO_DEVICE = "needs a CUDA device"  # their skip reasons start so


def plan_suite(ctx: Context) -> dict:
    return {"files": list(FILES)}


def suite(ctx: Context) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *FILES]
    ctx.record("command", cmd)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.left_s(), 1))
        lines, code = (done.stdout + done.stderr).strip().splitlines(), done.returncode
    except subprocess.TimeoutExpired as e:
        lines, code = (e.stdout or b"").decode(errors="replace").splitlines(), None
    last = lines[-1] if lines else ""
    counts = {
        kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)
    }
    unseen = [line for line in lines if NO_DEVICE in line]
    ctx.record("counts", counts)
    ctx.record("skipped_for_want_of_a_device", unseen)
    ctx.record("tail", lines[-30:])
    ctx.record("ok", code == 0 and not unseen)
    ctx.record("summary", last if code is not None else "timed out: " + last)
    return ctx.result
