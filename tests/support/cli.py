"""Run the installed `moe-mesh` command as a user would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def moe_mesh(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("moe-mesh", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "moe_mesh"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=120)
