"""float32 products of a few rows on every thread, with F.linear's bits (bf16_kernel.c's
moe_sgemm_rows).

float32 must give transformers' tokens exactly, and transformers' float32 products are torch's
F.linear, which is MKL's sgemm: a near-tie in the logits flips on the last bit, so another
kernel's summation order will not do. But MKL runs a product of a few rows on one thread: on an
AVX2 host (AMD EPYC, 2 cores, 20 GB/s) a one-row product read 11 GB/s on one thread or two, a
4-row one 4.4 GB/s. Split by 64-row blocks of the weight, each block computed by the same sgemm
on one thread, the products read 17 GB/s at one row and 9.8 at four, and each output has the
bits F.linear gives it: MKL computes an output alike in whichever 64-aligned block of rows it
sits. Not at every product size, though: there, 5-7 and 9-11 input rows gave other bits (and
every other count up to 64 the same). So a process checks each row count on first use, and
splits only those that agree, and only where splitting is faster than F.linear (`rows`).

A decode pass small enough to run its ops on one thread (common.linear.serial_tokens) still
splits its float32 products over the whole team (`team`): waking the other threads costs more
than it gains for a norm of one row, not for a product that reads megabytes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from common import bf16

log = logging.getLogger(__name__)

MAX_ROWS = 64  # the largest product that is split; larger ones keep MKL's own threads
_CHECKED = ((256, 1024), (192, 1000))  # [out, in]: the weights a row count is checked on
_TIMED = (1536, 1024)  # a small model's qkv projection
_WORKING_SET = 64 << 20
_state = threading.local()  # this thread's `team` and `unsplit`


@functools.cache
def _sgemm() -> int | None:
    """The address of the sgemm torch's float32 products call (MKL's, inside libtorch_cpu), or
    None where torch has none to find."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _split(x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], weight.shape[0])
    n, k = weight.shape
    bf16.call(bf16.kernel("moe_sgemm_rows"), _sgemm(), x, weight, y, x.shape[0], n, k, threads)
    return y


@functools.cache
def rows(threads: int) -> frozenset[int]:
    """The input row counts (up to MAX_ROWS) whose float32 products are split over `threads`
    here: none where the kernel or sgemm is missing or where splitting is not faster. Checked
    against F.linear on as many threads, as a process with that many computes (at 5-11 rows MKL
    gave other bits on one thread than on two)."""
    if bf16.kernel("moe_sgemm_rows") is None or _sgemm() is None or threads < 2:
        return frozenset()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        began = time.perf_counter()
        same = _same_bits(threads)
        ratio = _time_ratio(threads)
    finally:
        torch.set_num_threads(before)
    chosen = same if ratio < 0.9 else frozenset()
    log.info(
        "float32 products split over %d threads took %.2f× F.linear's time, same bits at %d of "
        "%d row counts: %s (checked in %.2f s)",
        threads,
        ratio,
        len(same),
        MAX_ROWS,
        "split" if chosen else "not split",
        time.perf_counter() - began,
    )
    return chosen


def _same_bits(threads: int) -> frozenset[int]:
    """The row counts at which the split gives F.linear's bits on _CHECKED's weights."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) for shape in _CHECKED]
    same = set()
    for m in range(1, MAX_ROWS + 1):
        xs = [torch.randn(m, w.shape[1], generator=gen) for w in weights]
        if all(torch.equal(_split(x, w, threads), F.linear(x, w)) for x, w in zip(xs, weights)):
            same.add(m)
    return frozenset(same)


def _time_ratio(threads: int) -> float:
    """Geometric mean of the split's time ÷ F.linear's over 1-, 4- and 16-row products of
    _WORKING_SET bytes of weights (more than the caches hold, as a model's)."""
    count = _WORKING_SET // (_TIMED[0] * _TIMED[1] * 4)
    weights = [torch.full(_TIMED, 0.01) for _ in range(count)]
    ratio, sizes = 1.0, (1, 4, 16)
    for m in sizes:
        x = torch.full((m, _TIMED[1]), 0.01)
        ratio *= _best(functools.partial(_split, threads=threads), x, weights)
        ratio /= _best(F.linear, x, weights)
    return ratio ** (1 / len(sizes))


def _best(product: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    best = float("inf")
    for i in range(4):
        start = time.perf_counter()
        for w in weights:
            product(x, w)
        if i:  # the first pass sets MKL up for this shape
            best = min(best, time.perf_counter() - start)
    return best


@contextmanager
def team(threads: int) -> Iterator[None]:
    """Within, this thread's float32 products split over `threads`, whatever torch's count."""
    before, _state.team = getattr(_state, "team", 0), threads
    try:
        yield
    finally:
        _state.team = before


@contextmanager
def unsplit() -> Iterator[None]:
    """Within, this thread's float32 products are F.linear's own (serial_tokens times those)."""
    before, _state.unsplit = getattr(_state, "unsplit", False), True
    try:
        yield
    finally:
        _state.unsplit = before


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [m, in] · weightᵀ split over the threads, F.linear's bits; None where it is not split
    here (the caller runs F.linear)."""
    threads = getattr(_state, "team", 0) or torch.get_num_threads()
    if (
        getattr(_state, "unsplit", False)
        or threads < 2
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.dim() != 2
        or weight.device.type != "cpu"
        or weight.shape[0] % 64
        or bf16.kernel("moe_sgemm_rows") is None
        or not (x.is_contiguous() and weight.is_contiguous())
        or x.shape[0] not in rows(threads)
    ):
        return None
    return _split(x, weight, threads)
