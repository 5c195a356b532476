"""Building moe-mesh's C kernels (bf16_kernel.c and the files it includes) into a shared library.

The sources are compiled on first use with the host's compiler (`$CC`, else `cc`) into
$MOE_MESH_CACHE_DIR (default ~/.cache/moe-mesh), once per source version and flags: a file named
by their hash, written whole or not at all, so processes that start together build it at most
once each and load the same file. common/bf16.py loads it and says which kernels this CPU runs.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from common.errors import InvalidArgumentError

# bf16_kernel.c includes the others
_SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "bf16_kernel.c",
        "quant_kernel.c",
        "quant_avx512.c",
        "int_dot.c",
        "f32_kernel.c",
        "f32_lanes.c",
        "decode_kernel.c",
        "f32_step.c",
        "f32_experts.c",
        "sgemv4.c",
        "amx_kernel.c",
    )
]
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_PHASES = "-DMOE_STEP_PHASES"


def cache_dir() -> Path:
    if root := os.environ.get("MOE_MESH_CACHE_DIR"):
        return Path(root)
    return Path.home() / ".cache" / "moe-mesh"


ISAS = {"none": 0, "avx2": 1, "avx512": 2, "all": 3}  # MOE_MESH_MAX_ISA's values: bf16.level's


def max_isa() -> int:
    """MOE_MESH_MAX_ISA: the highest instruction set the kernels may use, as oneDNN's
    ONEDNN_MAX_CPU_ISA (to run another host kind's code on this one); torch-free, so a command
    checks it before it starts anything."""
    name = os.environ.get("MOE_MESH_MAX_ISA", "")
    if (key := name.strip().lower() or "all") not in ISAS:  # set but empty: unset
        raise InvalidArgumentError("MOE_MESH_MAX_ISA", f"{name!r} is not one of {', '.join(ISAS)}")
    return ISAS[key]


def step_phases() -> bool:
    """MOE_MESH_STEP_PHASES=1: a build of the kernels whose decode step times its phases
    (decode_kernel.c; bench/step_phases.py reads them). A tool's, not a server's: off by default."""
    return os.environ.get("MOE_MESH_STEP_PHASES", "0").lower() in ("1", "on", "true", "yes")


def built() -> Path:
    """The shared library of the current sources, built first where it is not yet; OSError or
    subprocess.SubprocessError where it cannot be (no compiler, a failed build)."""
    compiler = os.environ.get("CC", "cc")
    sources = b"".join(s.read_bytes() for s in _SOURCES)
    flags, name = (_FLAGS, "bf16") if not step_phases() else ([*_FLAGS, _PHASES], "bf16phases")
    tag = hashlib.sha256(sources + " ".join([compiler, *flags]).encode())
    path = cache_dir() / f"{name}-{tag.hexdigest()[:16]}.so"
    if not path.exists():
        _build(compiler, flags, path, name)
    return path


def _build(compiler: str, flags: list[str], path: Path, name: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, str(_SOURCES[0]), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode:
            raise subprocess.SubprocessError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)  # whole or not at all, however many processes build at once
        for old in path.parent.glob(f"{name}-*.so"):  # earlier sources' (a mapped one lives on)
            if old != path:
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
