"""float32 products of a few rows on every thread, with F.linear's bits (bf16_kernel.c's
moe_sgemm_rows).

float32 must give transformers' tokens exactly, and transformers' float32 products are torch's
F.linear, which is MKL's sgemm: a near-tie in the logits flips on the last bit, so another
kernel's summation order will not do. But MKL runs a product of a few rows on one thread: on an
AVX2 host (AMD EPYC, 2 cores, 20 GB/s) a one-row product read 11 GB/s on one thread or two, a
4-row one 4.4 GB/s. Split by 64-row blocks of the weight, each block computed by the same sgemm
on one thread, the products read 17 GB/s at one row and 9.8 at four, and an output mostly has
the bits F.linear gives it. Not always: there, at 5-7 and 9-11 input rows F.linear's bits
depended on its own thread count, and the split's matched its one-thread bits. So each shape
and row count is checked the first time it comes (one product computed both ways), and split
from then on only if the bits agreed; and only on a host where splitting measured faster.

A decode pass small enough to run its ops on one thread (common.linear.serial_tokens) still
computes its float32 products on the whole team (`team`): waking the other threads costs more
than it gains for a norm of one row, not for a product that reads megabytes; and F.linear's
bits at some row counts depend on its threads, so one that is not split runs on the team too.

On AVX-512, MKL's kernel for 2-15 rows sums an output in an order moe-mesh's kernel repeats
(common/f32_lanes.c), and reads the weights faster from 4 rows on: on a 2-core AMX host (Intel
Xeon, 30 GB/s), 256 MiB of [2048, 1024] products at 8 rows read 16 GB/s against MKL's 10, at
15 rows 12 against 7. Those products run on it, each shape and row count checked first as a
split's is; at 2 and 3 rows MKL's own reads as fast. Its one-row kernel sums in another order,
which f32_lanes.c repeats too, for a layer's experts in one call (common/float32_ffns.py:
lanes_agree checks those products); one at a time it reads no faster than MKL's.

Where MKL does not run its Intel kernels (AMD EPYC), it sums a one-row product in another order
again, which common/sgemv4.c repeats; the split computes one-row products there (`mkl`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
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
LANES_ROWS = range(4, 16)  # the products float32.linear computes on f32_lanes.c
_TIMED = (1536, 1024)  # a small model's qkv projection
_HALVES_ROWS = (*range(1, MAX_ROWS + 1), 128, 256)
_WORKING_SET = 32 << 20  # more than the caches hold, as a model's weights
_state = threading.local()  # this thread's `team` and `unsplit`
# _key's (way, out, in, rows, threads, offsets): whether that way ("lanes" or "split") gave
# F.linear's bits the first time
_verdicts: dict[tuple, bool] = {}


def mkl() -> tuple[int, int] | None:
    """The addresses of MKL's sgemm (what torch's float32 products call) and its
    MKL_Set_Num_Threads_Local, inside libtorch_cpu; None where torch's BLAS is not MKL. Each call
    also tells the loaded kernels (a library may be loaded anew) whether moe_sgemm_rows computes
    one-row products itself: where MKL sums them as common/sgemv4.c does. On host E (AMD EPYC)
    that read 1.2-1.4x MKL's bytes a second on one thread, and float32 decode ran 2-11% faster,
    with the same tokens."""
    addresses = _mkl_addresses()
    if addresses is not None and (use := bf16.kernel("moe_sgemv4_use")) is not None:
        use(int(_sums_as_sgemv4()))
    return addresses


@functools.cache
def _mkl_addresses() -> tuple[int, int] | None:
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        functions = (lib.sgemm_, lib.MKL_Set_Num_Threads_Local)  # C, not Fortran, arguments
    except (OSError, AttributeError):
        return None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in functions)


@functools.cache
def _sums_as_sgemv4() -> bool:
    """Whether F.linear gives one-row products sgemv4.c's bits here, on widths of every
    remainder mod 4, each at all four float offsets from 16 bytes."""
    gen = torch.Generator().manual_seed(0)
    for k in (1024, 1023, 770, 33):
        for offset in range(4):
            w = torch.randn(8 * k + offset, generator=gen)[offset:].view(8, k)
            x, y = torch.randn(1, k, generator=gen), torch.empty(8)
            bf16.call(bf16.kernel("moe_sgemv4"), x, w, y, 8, k)
            if not torch.equal(y, F.linear(x, w)[0]):
                log.info("float32 one-row products: MKL's own (it sums them another way here)")
                return False
    log.info("float32 one-row products: moe-mesh's kernel, which sums them as MKL does here")
    return True


@functools.cache
def sleef_exp() -> int | None:
    """The address of Sleef's expf8_u10 inside libtorch_cpu: what torch's float32 exp calls."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return ctypes.cast(lib.Sleef_expf8_u10, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


@functools.cache
def torch_lanes() -> int | None:
    """torch's float32 vector width on this host, whose softmax and SiLU the kernels repeat (its
    sums run 8 lanes everywhere: f32_step.c's SUM_LANES)."""
    return {"AVX2": 8, "AVX512": 16}.get(torch.backends.cpu.get_cpu_capability())


def team_threads() -> int:
    """The threads this thread's float32 products run on (`team`, else torch's count)."""
    return getattr(_state, "team", 0) or torch.get_num_threads()


def lanes_agree(rows: int, weight: torch.Tensor, team: int) -> bool:
    """Whether f32_lanes.c's kernels give F.linear's bits to `rows` rows (1 to 15) times `weight`
    on `team` threads, the rows at a cache line's start as a new tensor's are (checked now where
    that was not yet known). No product under `unsplit`: F.linear's own."""
    if getattr(_state, "unsplit", False) or not 0 < rows < 16 or weight.shape[-1] % 16:
        return False
    key = _key("lanes", weight, rows, team)
    if key not in _verdicts:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        if not _fits(x, weight) or _check(key, x, weight) is None:
            return False
    return _verdicts[key]


def _split(x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
    (n, k), m = weight.shape, x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device="cpu")
    bf16.call(bf16.kernel("moe_sgemm_rows"), *mkl(), x, weight, y, m, n, k, threads)
    return y


def _lanes(x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor | None:
    """None where the kernel refuses (held below AVX-512: tests)."""
    (n, k), m = weight.shape, x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device="cpu")
    return (
        None if bf16.call(bf16.kernel("moe_sgemm_lanes16"), x, weight, y, m, n, k, threads) else y
    )


@functools.cache
def faster(threads: int) -> bool:
    """Whether float32 products split over `threads` run faster than F.linear here (timed on
    first use; never where the kernel or MKL is missing)."""
    if threads < 2 or bf16.kernel("moe_sgemm_rows") is None or mkl() is None:
        return False
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # F.linear as a process of `threads` computes it
    try:
        began = time.perf_counter()
        ratio = _time_ratio(threads)
    finally:
        torch.set_num_threads(before)
    log.info(
        "float32 products split over %d threads took %.2f× F.linear's time: %s (%.2f s)",
        threads,
        ratio,
        "split" if ratio < 0.9 else "not split",
        time.perf_counter() - began,
    )
    return ratio < 0.9


def _time_ratio(threads: int) -> float:
    """Geometric mean of the split's time ÷ F.linear's over 1- and 4-row products (a decode
    step's) of _WORKING_SET bytes of weights: every router process pays for it at start-up."""
    count = max(2, _WORKING_SET // (_TIMED[0] * _TIMED[1] * 4))
    weights = [torch.full(_TIMED, 0.01) for _ in range(count)]
    ratio, sizes = 1.0, (1, 4)
    for m in sizes:
        x = torch.full((m, _TIMED[1]), 0.01)
        ratio *= _best(functools.partial(_split, threads=threads), x, weights)
        ratio /= _best(F.linear, x, weights)
    return ratio ** (1 / len(sizes))


def _best(product: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    best = float("inf")
    for i in range(3):
        start = time.perf_counter()
        for w in weights:
            product(x, w)
        if i:  # the first pass sets MKL up for this shape
            best = min(best, time.perf_counter() - start)
    return best


@contextmanager
def team(threads: int) -> Iterator[None]:
    """Within, this thread's float32 products run on `threads`, whatever torch's count."""
    before, _state.team = getattr(_state, "team", 0), threads
    try:
        yield
    finally:
        _state.team = before


@contextmanager
def unsplit() -> Iterator[None]:
    """Within, this thread's float32 products are F.linear's on torch's threads, as they are
    (serial_tokens times those)."""
    before, _state.unsplit = getattr(_state, "unsplit", False), True
    try:
        yield
    finally:
        _state.unsplit = before


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a plain float32 weight, its bits included: on moe-mesh's
    kernel or split over the threads where that gave the same bits, else F.linear on the team's
    threads."""
    if getattr(_state, "unsplit", False):
        return F.linear(x, weight, bias)
    threads = team_threads()
    for way in () if bias is not None else _ways(x, weight, threads):
        key = _key(way, weight, x.shape[0], threads, x.data_ptr() % 64)
        same = _verdicts.get(key)
        if same is None:
            y = _check(key, x, weight)
            if y is not None:
                return y
        elif same and (y := _run(way, x, weight, threads)) is not None:
            return y
    return _on(threads, x, weight, bias)


def _ways(x: torch.Tensor, weight: torch.Tensor, threads: int) -> tuple[str, ...]:
    """How `linear` may compute this product other than F.linear, in order of preference, each
    way's bits checked before it is used (the cheap tests first: a decode step makes hundreds of
    these calls)."""
    if x.dim() != 2 or weight.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS:
        return ()  # what F.linear refuses or a prefill computes: F.linear's
    rows = x.shape[0]
    lanes = rows in LANES_ROWS and x.shape[-1] % 16 == 0 and bf16.kernel("moe_sgemm_lanes16")
    ways = ("lanes",) if lanes else ()
    if _splittable(weight, threads):
        ways += ("split",)
    return ways if ways and _fits(x, weight) else ()


def _key(way: str, weight: torch.Tensor, rows: int, threads: int, x_offset: int = 0) -> tuple:
    """What a verdict holds for: MKL's sums may depend on where the operands lie (its one-row
    products' do), so their offsets from a cache line are part of it (x's: 0 for a new tensor)."""
    return (way, *weight.shape, rows, threads, weight.data_ptr() % 64, x_offset)


def splits(weight: torch.Tensor, rows: int, threads: int) -> bool:
    """Whether `linear` splits a product of `rows` rows by `weight` over `threads` (its bits
    checked now where they were not yet): engine/fused_f32.py's step computes it as linear does."""
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0))
    if not (_fits(x, weight) and _splittable(weight, threads)):
        return False
    key = _key("split", weight, rows, threads)
    if key not in _verdicts:
        _check(key, x, weight)
    return _verdicts[key]


def halves_agree(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether F.linear over `gate` and `up` [out, k] (views of a checkpoint) gives the bits of
    F.linear over them joined into a new tensor: transformers' one product over [gate; up]. Where
    it does, an expert's gate and up stored apart stay views of the checkpoint
    (common/checkpoint.py), with no joined copy. MKL's sum for an output does not depend on how
    many outputs there are (measured on AVX2 at 1-1000 input rows), but a one-row product's does
    depend on where its weight lies: so both views must sit where a new tensor would (64-byte
    aligned; a safetensors file puts its tensors where its header's length leaves them). `out` a
    multiple of 32, so that SiLU-and-multiply over the halves meets no vector tail the joined
    product's halves would not (torch's scalar tail rounds otherwise)."""
    aligned = all(t.data_ptr() % 64 == 0 for t in (gate, up))
    out, k = gate.shape
    return aligned and gate.shape == up.shape and out % 32 == 0 and _halves_agree(out, k)


@functools.cache
def _halves_agree(out: int, k: int) -> bool:
    """halves_agree for new tensors of this shape, checked once on random weights at every row
    count of _HALVES_ROWS (a decode batch's, a prefill chunk's share of an expert) on one thread
    and on every core this process may use (the counts its products run on; a load may run on
    any thread, whatever torch's count there). Holds 4 [out, k] matrices meanwhile."""
    began, generator = time.perf_counter(), torch.Generator().manual_seed(0)
    halves = [torch.randn(out, k, generator=generator) for _ in range(2)]
    joined = torch.cat(halves)
    inputs = [torch.randn(rows, k, generator=generator) for rows in _HALVES_ROWS]
    before, same = torch.get_num_threads(), True
    try:
        for threads in sorted({1, len(os.sched_getaffinity(0))}):
            torch.set_num_threads(threads)
            same = same and all(
                torch.equal(F.linear(x, joined), torch.cat([F.linear(x, h) for h in halves], 1))
                for x in inputs
            )
    finally:
        torch.set_num_threads(before)
    log.info(
        "float32 [%d, %d] products %s the bits of their halves' (checked in %.2f s)",
        2 * out, k, "have" if same else "differ from", time.perf_counter() - began,
    )  # fmt: skip
    return same


def _splittable(weight: torch.Tensor, threads: int) -> bool:
    return threads > 1 and weight.shape[0] % 64 == 0 and faster(threads)


def _run(way: str, x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor | None:
    return (_lanes if way == "lanes" else _split)(x, weight, threads)


def _check(key: tuple, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """F.linear's product, the bits of key's way compared with it on the way (its verdict);
    None, and no verdict, where that way could not compute it now."""
    way, threads = key[0], key[4]
    y = _run(way, x, weight, threads)
    if y is None:
        return None
    want = _on(threads, x, weight, None)
    same = _verdicts[key] = torch.equal(y, want)
    if not same:
        log.info("float32 %s: %s bits differ from F.linear's, not used", key[1:4], way)
    return want


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether moe-mesh's kernels take x [m, in] · weight [out, in]ᵀ: float32 on the CPU,
    contiguous, 1 to MAX_ROWS rows; whatever F.linear would refuse, they leave to it."""
    return (
        x.dtype == weight.dtype == torch.float32
        and x.dim() == weight.dim() == 2
        and x.device.type == weight.device.type == "cpu"
        and 0 < x.shape[0] <= MAX_ROWS
        and 0 < x.shape[1] == weight.shape[1]
        and 0 < weight.shape[0]
        and x.is_contiguous()
        and weight.is_contiguous()
        and bf16.kernel("moe_sgemm_rows") is not None
    )


def _on(threads: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.linear on `threads` threads."""
    before = torch.get_num_threads()
    if before == threads:
        return F.linear(x, weight, bias)
    torch.set_num_threads(threads)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.set_num_threads(before)
