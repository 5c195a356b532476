"""Linear layers in the layout, and decode passes on the threads, this host runs fastest, as measured.

Decoding reads every weight once per step, so a step's time is mostly GEMV/small-GEMM time, and
which kernel is fastest there depends on the CPU, not on the model. Measured on two hosts of the
same Xeon family (2 cores each):
- with AMX/avx512_bf16, oneDNN's prepacked weights ran 1-32-row products 2-4× faster than MKL on
  a plain [out, in] matrix; without them (no native bf16), one-row float32 products ran 15%
  slower prepacked (20 vs 28 GB/s) and 32-row ones 15% faster;
- one thread read 38 of two threads' 47 GB/s on the first host and 15 of 28 on the second,
  which decides whether a decode pass should leave the other cores asleep (the router's
  --serial-max-tokens).

So each process asks `plan(dtype)` once: it times these kernels on 64 MiB of weights (under a
second) and caches the answer per CPU, torch version and thread count in MOE_MESH_KERNEL_CACHE
(default ~/.cache/moe-mesh/kernels.json; `off` measures at every start). `prepack` and `linear`
follow it. MOE_MESH_PREPACK=on|off overrides the measured layout (plain tensors with `off`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Passes of at most this many tokens are decode-sized: what `serial` applies to.
SERIAL_TOKENS = 32
# One thread is kept for decode passes unless all threads read at least this much faster: the
# first host's 1.24× lost to waking the other thread for every small op (serial won by 7-36% in
# the engine), the second host's 1.9× did not (serial lost 20-30%).
_PARALLEL_GAIN = 1.5
# A kernel must be this much faster than torch's own path to replace it: closer is timing noise.
_MARGIN = 0.9


@dataclass(frozen=True)
class KernelPlan:
    """What this host runs fastest for one dtype (see the module docstring)."""

    packed: bool  # hold linear weights in oneDNN's prepacked layout
    serial: bool  # decode-sized passes run on one thread
    seconds: float = 0.0  # what measuring took (0: read from the cache or forced)


_lock = threading.Lock()


def _prepack_env() -> str:
    value = os.environ.get("MOE_MESH_PREPACK", "auto").lower()
    if value in ("off", "0", "false", "no"):
        return "off"
    return "on" if value in ("on", "1", "true", "yes") else "auto"


def _can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@functools.cache
def plan(dtype: torch.dtype) -> KernelPlan:
    """This host's kernel plan for `dtype`: from the cache, else measured (and cached)."""
    with _lock:
        key = _host_key(dtype)
        cached = _read_cache().get(key)
        found = _from_json(cached) if cached else None
        chosen = found or _measure(dtype)
        if found is None:
            _write_cache(key, chosen)
            log.info("kernel plan for %s measured in %.2f s: %s", dtype, chosen.seconds, chosen)
    prepack = _prepack_env()
    if prepack != "auto":
        chosen = replace(chosen, packed=prepack == "on" and _can_pack(dtype))
    return chosen


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout when that is faster here, else unchanged."""
    if weight.device.type != "cpu" or not weight.is_floating_point() or weight.is_mkldnn:
        return weight
    if not plan(weight.dtype).packed:
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] · weightᵀ (+ bias) -> [n, out], for a plain or a prepacked weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# -- measuring --------------------------------------------------------------------------------


def _measure(dtype: torch.dtype, working_set: int = 64 << 20) -> KernelPlan:
    began = time.perf_counter()
    shape = (2048, 1024)  # the size of a small expert's projection
    count = max(2, working_set // (shape[0] * shape[1] * dtype.itemsize))
    # More bytes than a core's caches hold, so products read memory as a model's do.
    plain = [torch.full(shape, 0.01, dtype=dtype) for _ in range(count)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in plain] if _can_pack(dtype) else []

    def speed(weights: list[torch.Tensor], rows: int, fn: Callable = F.linear) -> float:
        x = torch.full((rows, shape[1]), 0.01, dtype=dtype)
        return _best_seconds(lambda: [fn(x, w) for w in weights])

    def packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    use_packed = False
    if packed:  # decode-sized products, rows spread log-uniformly; each counts alike
        ratio = 1.0
        for rows in (1, 4, 16, 64):
            ratio *= speed(packed, rows, packed_linear) / speed(plain, rows)
        use_packed = ratio ** (1 / 4) < _MARGIN
    weights, fn = (packed, packed_linear) if use_packed else (plain, F.linear)

    serial = True
    threads = torch.get_num_threads()
    if threads > 1:
        parallel_s = speed(weights, 1, fn)
        torch.set_num_threads(1)
        try:
            serial_s = speed(weights, 1, fn)
        finally:
            torch.set_num_threads(threads)
        serial = serial_s < _PARALLEL_GAIN * parallel_s
    return KernelPlan(use_packed, serial, time.perf_counter() - began)


def _best_seconds(run: Callable[[], object], repeats: int = 3) -> float:
    run()  # one-time kernel set-up for this shape
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


# -- the cache --------------------------------------------------------------------------------


def _cache_path() -> Path | None:
    value = os.environ.get("MOE_MESH_KERNEL_CACHE", "")
    if value.lower() == "off":
        return None
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moe-mesh" / "kernels.json"


def _host_key(dtype: torch.dtype) -> str:
    """The CPU (model and instruction set), torch's version and thread count, and the dtype."""
    cpu = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
        cpu = "\n".join(dict.fromkeys(lines))  # the first CPU's; every core has the same
    except OSError:
        import platform

        cpu = platform.processor()
    digest = hashlib.sha256(cpu.encode()).hexdigest()[:16]
    return f"{digest} torch {torch.__version__} threads {torch.get_num_threads()} {dtype}"


def _read_cache() -> dict:
    path = _cache_path()
    try:
        data = json.loads(path.read_text()) if path else {}
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or torn: measure again


def _write_cache(key: str, p: KernelPlan) -> None:
    path = _cache_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache() | {key: asdict(p)}
        # Whole or not at all: services starting together may write at once.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(data, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:  # a read-only home costs a measurement per start, nothing else
        log.warning("cannot cache the kernel plan in %s: %s", path, e)


def _from_json(value: object) -> KernelPlan | None:
    try:
        p = KernelPlan(**value)  # type: ignore[arg-type]
    except TypeError:
        return None
    ok = isinstance(p.packed, bool) and isinstance(p.serial, bool)
    return KernelPlan(p.packed, p.serial) if ok else None
