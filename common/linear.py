"""Linear layers, and the threads of a decode pass, chosen by measuring this host at start-up.

Decoding reads every weight once per step, so a step's time is mostly GEMV/small-GEMM time, and
which kernel is fastest there depends on the CPU, not on the model. Measured on two hosts of the
same Xeon family (2 cores each):
- with AMX/avx512_bf16, oneDNN's prepacked weights ran 1-32-row products 2-4× faster than MKL on
  a plain [out, in] matrix; without them (no native bf16), one-row float32 products ran 15%
  slower prepacked (20 vs 28 GB/s) and 32-row ones 15% faster, and their last bits differed
  from MKL's enough to flip greedy near-ties against transformers (float32 must not: it is
  prepacked only where the products are bit-identical to torch's);
- one thread read 38 of two threads' 47 GB/s on the first host and 15 of 28 on the second,
  which decides whether a decode pass should leave the other cores asleep (the router's
  --serial-max-tokens).

So a process measures both on first use, on 64 MiB of weights (0.1-0.5 s), and follows what it
found: `prepack` holds weights in the faster layout, and the router asks `serial_tokens` for its
default --serial-max-tokens. Not cached across processes: a measurement disturbed by a busy
neighbour must not outlive the process that took it.
Two layouts follow a rule instead, so that every process on a host holds the same one (one copy
a host, mapped from a file, and the same bits in every replica): bfloat16 weights are held for
moe-mesh's own kernel (common.bf16, `panels`) and batch-invariant float32 ones (an expert
service's) are read as stored by it (`float32_as_stored`), wherever it runs.
MOE_MESH_PREPACK overrides both: `on` oneDNN's layout, `off` plain tensors, `panels` (the
default's bfloat16 layout) moe-mesh's own kernel wherever it runs.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import bf16, float32, float32_rows

log = logging.getLogger(__name__)

# Passes of at most this many tokens are decode-sized: the most `serial_tokens` returns.
SERIAL_TOKENS = 32
_SERIAL_ROWS = (1, 4, 16, SERIAL_TOKENS)  # the product sizes serial_tokens times
# Products of a pass's size keep one thread unless all threads run them at least this much
# faster: a host at 1.24× on one-row products lost to waking the other thread for every small
# op (serial won by 7-36% in the engine); one at 1.41× did not (serial lost 15%, and 23-35% at 8
# and 32 tokens, where its products gained 1.6-1.7×).
_PARALLEL_GAIN = 1.3
# oneDNN's layout must be this much faster than torch's own path to replace it: closer is noise.
_MARGIN = 0.9
_SHAPE = (2048, 1024)  # a small expert's projection
_ROWS = (1, 4, 16, 64)  # the product sizes a layout is timed at
_WORKING_SET = 64 << 20  # more than a core's caches: products read memory as a model's do


def _prepack_setting() -> str:
    value = os.environ.get("MOE_MESH_PREPACK", "auto").lower()
    if value in ("off", "0", "false", "no"):
        return "off"
    if value == "panels":
        return value
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
def packed(dtype: torch.dtype) -> bool:
    """Whether `dtype` weights are held in oneDNN's prepacked layout in this process."""
    forced = _prepack_setting()
    if forced == "off" or not _can_pack(dtype):
        return False
    if forced in ("on", "panels"):
        return True
    if dtype == torch.float32 and not _same_bits():
        # float32 must give transformers' tokens exactly, and near-ties flip on the last bit.
        log.info("float32 weights plain: prepacked products differ from torch's in the last bits")
        return False
    began = time.perf_counter()
    layout = _times(_weights(dtype, _pack), _packed_linear)
    ratio = _time_ratio(layout.__getitem__, _times(_weights(dtype), F.linear).__getitem__)
    faster = ratio < _MARGIN
    log.info(
        "%s weights %s: prepacked took %.2f× plain's time (measured in %.2f s)",
        dtype,
        "prepacked" if faster else "plain",
        ratio,
        time.perf_counter() - began,
    )
    return faster


@functools.cache
def panels(dtype: torch.dtype) -> bool:
    """Whether `dtype` weights are held for moe-mesh's own kernel (bf16.Panels) in this process:
    bfloat16 wherever the kernel runs, unless MOE_MESH_PREPACK says `on` or `off`. A rule, not a
    start-up timing: on host C (AMX) the kernel took 0.45-1.07× oneDNN's time in services starting
    together, which then held two copies and computed different bits. In panels the engine decodes
    a step in one kernel call (common/decode_kernel.c) and a host maps one copy (common.packcache):
    on host C it decoded 2.7×, 2.2× and 1.5× faster than with oneDNN's layout at batch 1, 8 and
    32, though oneDNN's AMX products of 16-64 rows are 1.4-3× faster. The cost is prefill: there
    128-row products of an expert's panels read 2.5 GB/s against oneDNN's 10 (a router's dense
    panels take AMX tiles: amx_kernel.c), and `small` prefilled 480 tokens in 290 ms against
    oneDNN's 165 (MOE_MESH_PREPACK=on)."""
    forced = _prepack_setting()
    return (
        dtype == torch.bfloat16
        and forced not in ("off", "on")
        and bf16.kernel("moe_linear") is not None
    )


def float32_as_stored() -> bool:
    """Whether batch-invariant float32 weights (an expert service's) are used as stored, by
    moe-mesh's kernel (common.float32_rows: views of the file, one copy a host), rather than
    copied into oneDNN's layout: wherever the kernel runs, unless MOE_MESH_PREPACK says `on` or
    `off`. Not by a measurement at start-up, as the other layouts are: on host B that timing gave
    0.52-2.09x oneDNN's time for four services starting together against 0.68-0.86x for one
    alone, and replicas that chose differently would hold two copies and answer in different
    bits."""
    return _prepack_setting() not in ("off", "on") and bf16.kernel("moe_f32_linear") is not None


def in_float32_rows(dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether `prepack(batch_invariant=True)` holds a `dtype` weight of `shape` as
    float32_rows.Rows (as stored) here."""
    return dtype == torch.float32 and float32_rows.fits(shape) and float32_as_stored()


def in_panels(dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether `prepack` holds a `dtype` weight of `shape` [out, in] as bf16.Panels here."""
    return panels(dtype) and len(shape) == 2 and shape[0] % bf16.COLUMNS == 0


@functools.cache
def serial_tokens(dtype: torch.dtype) -> int:
    """The largest decode pass (tokens, up to SERIAL_TOKENS) of `dtype` weights that runs on one
    thread: products of up to that many rows gain less than _PARALLEL_GAIN from all threads, so
    waking them for each of a pass's ops is not worth it. 0: every pass on every thread."""
    threads = torch.get_num_threads()
    if threads == 1:
        return SERIAL_TOKENS
    weights = _weights(dtype, prepack)
    serial, gains = 0, []
    for rows in _SERIAL_ROWS:
        # A serial pass splits float32 products over every thread all the same (float32.team):
        # F.linear's own threads stand for how its other ops gain from them.
        with float32.unsplit():
            every = _seconds(weights, rows, linear, repeats=5)
            torch.set_num_threads(1)
            try:
                one = _seconds(weights, rows, linear, repeats=5)
            finally:
                torch.set_num_threads(threads)
        gains.append(f"{rows} rows {one / every:.2f}×")
        if one >= _PARALLEL_GAIN * every:
            break
        serial = rows
    log.info(
        "%s products on %d threads vs one: %s; passes of up to %d tokens on one thread",
        dtype,
        threads,
        ", ".join(gains),
        serial,
    )
    return serial


def prepack(
    weight: torch.Tensor, batch_invariant: bool = False, tiles: bool = False
) -> torch.Tensor | bf16.Panels | float32_rows.Rows:
    """`weight` [out, in] in this host's layout for its dtype (bfloat16: moe-mesh's panels where
    the kernel runs; float32: oneDNN's blocked layout where measured faster), else unchanged.

    `batch_invariant`: products that give a row the same bits whatever else is in the batch; MKL's
    small-batch kernels do not (an 8-row product's rows differ from the same rows inside a 40-row
    one). An expert service merges its callers' rows into one batch, so its answers must not
    depend on their batch-mates. bfloat16 panels where the kernel runs, float32 as stored for
    moe-mesh's kernel where it runs (float32_as_stored), else oneDNN's layout wherever it has the
    dtype, faster or not.

    `tiles` (a router's dense weights): bfloat16 products of 8 rows and more on AMX tiles where
    the CPU has them (bf16.Panels), unless batch-invariant."""
    if weight.device.type != "cpu" or weight.is_mkldnn:
        return weight
    if in_panels(
        weight.dtype, tuple(weight.shape)
    ):  # batch-invariant too: a sum per output in order
        return bf16.Panels(weight, tiles=tiles and not batch_invariant)
    if batch_invariant and in_float32_rows(weight.dtype, tuple(weight.shape)):
        return float32_rows.Rows(weight)
    if batch_invariant:
        wanted = _prepack_setting() != "off" and _can_pack(weight.dtype)
    else:
        wanted = packed(weight.dtype)
    return _pack(weight) if wanted else weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] · weightᵀ (+ bias) -> [n, out], for a plain or a prepacked weight."""
    if isinstance(weight, (bf16.Panels, float32_rows.Rows)):
        return weight(x, bias)
    if weight.is_mkldnn:
        return _packed_linear(x, weight, bias)
    if weight.dtype == torch.float32 and weight.device.type == "cpu":
        return float32.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _same_bits() -> bool:
    """Whether oneDNN's float32 products are bit-identical to torch's (MKL's) here."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=gen)
    layout = _pack(w)
    for rows in (1, 4, 16, 64):
        x = torch.randn(rows, 1024, generator=gen)
        if not torch.equal(_packed_linear(x, layout), F.linear(x, w)):
            return False
    return True


def _time_ratio(candidate: Callable[[int], float], baseline: Callable[[int], float]) -> float:
    """Geometric mean of candidate's time ÷ baseline's over decode-sized products (seconds of a
    pass of `rows`-row products each): rows spread log-uniformly, each counting alike."""
    ratio = 1.0
    for rows in _ROWS:
        ratio *= candidate(rows) / baseline(rows)
    return ratio ** (1 / len(_ROWS))


def _weights(dtype: torch.dtype, layout: Callable[[torch.Tensor], object] | None = None) -> list:
    """_WORKING_SET bytes of `dtype` weights, each in `layout` (plain without), made one at a
    time: a measurement holds one layout's working set at once, not two (an expert service's
    peak memory: 128 MiB over its floor with two)."""
    count = max(2, _WORKING_SET // (_SHAPE[0] * _SHAPE[1] * dtype.itemsize))
    plain = (torch.full(_SHAPE, 0.01, dtype=dtype) for _ in range(count))
    return list(plain) if layout is None else [layout(w) for w in plain]


def _times(weights: list, product: Callable) -> dict[int, float]:
    """_seconds of `weights` at each of _ROWS; `weights` is then let go."""
    times = {rows: _seconds(weights, rows, product) for rows in _ROWS}
    weights.clear()
    return times


def _seconds(weights: list[torch.Tensor], rows: int, product: Callable, repeats: int = 3) -> float:
    """Best time of a pass of `rows`-row products over `weights` (after one untimed pass)."""
    x = torch.full((rows, _SHAPE[1]), 0.01, dtype=weights[0].dtype)
    if rows > 4:  # compute-bound, not read-bound: a quarter of the bytes times them as well
        weights = weights[: max(2, len(weights) // 4)]
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        for w in weights:
            product(x, w)
        if i:  # the first pass sets the kernels up for this shape
            best = min(best, time.perf_counter() - start)
    return best
