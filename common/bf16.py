"""moe-mesh's own bfloat16 kernels (bf16_kernel.c) for CPUs without bfloat16 instructions.

Without avx512_bf16 or AMX, oneDNN converts bfloat16 weights on the way to float32 arithmetic at
a cost: on this project's 2-core Xeon its prepacked products of 4-32 rows read weights at
1.4-7 GB/s, slower than float32 on twice the bytes; on an AVX2-only host (AMD EPYC, 2 cores)
oneDNN has no bfloat16 layout and torch's F.linear read 11.6 GB/s at one row, 0.55-4.2 at 4-32
rows (2 threads, 256 MiB of weights; the host read 21.4 GB/s). The kernel widens bfloat16 to
float32 in registers (a bfloat16 is a float32's upper half) from a layout made for it
(`Panels`): on the Xeon (AVX-512) 2.2-4× oneDNN's speed at 4-32 rows and 1.1-1.45× at one row
on 1-16 MiB weights; on the EPYC (AVX2) 15.9 GB/s at one row (1.4× torch, 74% of the read
bandwidth) and 2.9-6.4× torch at 4-32 rows. EPYC figures from a host shared with other jobs.
With AMX (host C) oneDNN's products of 16 rows and more are faster; common.linear.panels says
why bfloat16 weights are panels wherever the kernel runs all the same.

Where weights are panels, a gated expert FFN (`silu_ffn`) is one call too, every routed expert
of a layer together is one (`silu_ffns`), and so is RMSNorm with the residual addition before it
(`rms_norm`). In bfloat16 and float32 so are a layer's expert combine (`combine`) and its
grouping of tokens by expert (`group`); common/attention_kernels.py has RoPE, the KV-cache write
and decode attention. Each rounds where torch's op-by-op recipe rounds.

What runs where (`level`, `kernel`): the vector kernels (linear, silu_ffn, rms_norm, combine,
decode attention) on AVX-512F/BW or on AVX2+FMA, with the same bits on both; rope, kv_write and
group (plain C) on any x86-64, built on first use (common/kernel_build.py); a kernel that cannot
run here (no compiler, neither instruction set, or MOE_MESH_MAX_ISA below it) returns None and
torch computes its op, and that is logged.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable, Sequence

import torch

from common import kernel_build

log = logging.getLogger(__name__)

COLUMNS = 64  # output columns per kernel call: a weight's row count must be a multiple
PANEL = 32  # rows of a weight packed together (moe_bf16_pack)
# What moe_bf16_pack writes: a packed-weight cache file (common.packcache) built for another
# layout is stale. Change it with moe_bf16_pack.
LAYOUT = "panels of 32 columns, steps in pairs, v2"


_C_TYPES = {"i": ctypes.c_int, "l": ctypes.c_long, "f": ctypes.c_float, "p": ctypes.c_void_p}
# Each kernel's arguments, a letter each (int, long, float, pointer), whether it returns an int
# (a failure flag), and the CPU level it needs (moe_bf16_supported: 2 AVX-512F/BW, 1 AVX2+FMA,
# 0 any: plain C); as declared in bf16_kernel.c.
_SIGNATURES = {
    "moe_bf16_supported": ("", True, 0),
    "moe_bf16_limit": ("i", False, 0),
    "moe_bf16_pack": ("ppll", False, 0),
    "moe_argmax_bf16": ("pl", True, 0),
    "moe_int8_dot": ("l", True, 0),
    "moe_linear": ("ilpppppllli", True, 1),
    "moe_silu_ffns": ("ilpppppppllli", True, 1),
    "moe_quantize": ("ilpillppi", False, 0),
    "moe_rope_f32": ("plppplll", False, 0),
    "moe_rope_bf16": ("plppplll", False, 0),
    "moe_bf16_rms_norm": ("pppppllfi", False, 1),
    "moe_combine": ("ppplipilllipi", True, 1),
    "moe_group": ("pllippp", True, 0),
    "moe_kv_write": ("iplplplllllpp", False, 0),
    "moe_decode_attention": ("iplppplplllllllfpi", True, 1),
    "moe_decode_step_attention": ("iplppppppplpllllllfpi", True, 1),
    "moe_route": ("pplllliippi", True, 1),
    "moe_decode_step": ("ppppppi", True, 1),
    "moe_decode_burst": ("pppppppi", True, 1),
    "moe_sgemm_rows": ("pppppllli", False, 0),
    "moe_sgemv4": ("pppll", False, 0),
    "moe_sgemv4_use": ("i", False, 0),
    "moe_f32_linear": ("ppppllli", False, 1),
    "moe_sgemm_lanes16": ("pppllli", True, 2),
    "moe_decode_step_f32": ("plppplllppppi", True, 1),
    "moe_silu_ffns_f32": ("pppppplllpii", True, 2),
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot be built here (no compiler); `kernel` says
    which of them this CPU runs, held to MOE_MESH_MAX_ISA (InvalidArgumentError for a bad one)."""
    cap = kernel_build.max_isa()  # first: a typo is refused before a build, compiler or not
    try:
        path = kernel_build.built()
        lib = ctypes.CDLL(str(path))  # its libgomp is the one torch loaded: one thread pool
    except (OSError, subprocess.SubprocessError) as e:
        log.info("bfloat16 kernel unavailable: %s", e)
        return None
    for name, (arguments, returns_int, _) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = [_C_TYPES[a] for a in arguments]
        function.restype = ctypes.c_int if returns_int else None
    lib.level = min(lib.moe_bf16_supported(), cap)
    lib.moe_bf16_limit(cap)  # a ceiling: at 3, int8's dot products still run where AMX does not
    held = f"; this CPU has {_LEVELS[lib.moe_bf16_supported()]}, MOE_MESH_MAX_ISA holds it lower"
    log.info("bfloat16 kernels: %s%s", _LEVELS[lib.level], held if cap < 3 else "")
    return lib


_LEVELS = (
    "plain C only (torch computes the products)",
    "AVX2+FMA",
    "AVX-512",
    "AVX-512, and AMX tiles for the router's dense products of 8 rows and more",
)


def level() -> int:
    """The instruction set the vector kernels use here (no higher than MOE_MESH_MAX_ISA): 3
    AVX-512F/BW and AMX tiles, 2 AVX-512F/BW, 1 AVX2+FMA, 0 none (or no compiler)."""
    lib = library()
    return 0 if lib is None else lib.level


def kernel(name: str) -> Callable[..., int | None] | None:
    """The C function `name` where this host runs it (built, and the CPU level it needs), else
    None: its caller leaves the work to torch."""
    lib = library()
    if lib is None or lib.level < _SIGNATURES[name][2]:
        return None
    return getattr(lib, name)


def fits(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] can be held as Panels."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] % COLUMNS == 0
        and kernel("moe_linear") is not None
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' RMSNorm of bfloat16 x [..., h] by weight [h] in one kernel call (a decode step
    runs two per layer, and the eight torch ops of the recipe cost ~60 us each call here, their
    caches cold after the weights streamed through). With `delta`, of x + delta, the residual
    addition before the norm, in the same call. Returns (x + delta or x, the norm); None where the
    kernel cannot take them."""
    run = kernel("moe_bf16_rms_norm")
    h = x.shape[-1]
    if (
        run is None
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or weight.shape != (h,)
        or h % 16
        or (delta is not None and (delta.dtype, delta.shape) != (x.dtype, x.shape))
    ):
        return None
    rows, w = dense(x), dense(weight)  # held here while the kernel reads them
    d = None if delta is None else dense(delta)
    total = rows if d is None else torch.empty_like(rows)
    y = torch.empty_like(rows)
    call(run, rows, d, total, w, y, rows.numel() // h, h, eps, torch.get_num_threads())
    return total, y


def group(
    experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """experts [n, k] (int64) grouped by expert in one call instead of five torch calls: (order,
    tokens, counts) as moe.group_by_expert computes them with a stable argsort (the flat choices
    sorted by expert, their tokens, and the choices per expert); None without the kernel or for
    an expert id out of range."""
    run = kernel("moe_group")
    if (
        run is None
        or experts.dtype != torch.int64
        or experts.dim() != 2
        or experts.device.type != "cpu"
    ):
        return None
    flat = experts.contiguous()
    n, k = flat.shape
    order = torch.empty(n * k, dtype=torch.int64)
    tokens = torch.empty(n * k, dtype=torch.int64)
    counts = torch.empty(num_experts, dtype=torch.int64)
    if run(
        flat.data_ptr(), n, k, num_experts, order.data_ptr(), tokens.data_ptr(), counts.data_ptr()
    ):
        return None
    return order, tokens, counts.tolist()


def route(
    x: torch.Tensor, weight: torch.Tensor, k: int, renorm: bool, weights_bf16: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The softmax router of bfloat16 tokens x [n, hidden] over a plain weight [experts, hidden]
    in one call: (experts [n, k] int64, weights [n, k] float32 or bfloat16), the k most probable
    per token, renormalised with `renorm` (moe.route's rule). The fused decode step routes with
    the same C function, so both give the same bits. None where the kernel cannot take them."""
    run = kernel("moe_route")
    n, hidden = x.shape if x.dim() == 2 else (0, 0)
    if (
        run is None
        or not n
        or x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or not isinstance(weight, torch.Tensor)
        or weight.is_mkldnn
        or weight.dtype != torch.bfloat16
        or weight.dim() != 2
        or weight.shape[1] != hidden
        or hidden % 16
        or not 0 < k <= weight.shape[0]
    ):
        return None
    rows, w = dense(x), dense(weight)  # held here while the kernel reads them
    chosen = torch.empty(n, k, dtype=torch.int64)
    weights = torch.empty(n, k, dtype=torch.bfloat16 if weights_bf16 else torch.float32)
    shape = (n, hidden, weight.shape[0], k, renorm, weights_bf16)
    if call(run, rows, w, *shape, weights, chosen, torch.get_num_threads()):
        raise MemoryError(f"router: no memory for {weight.shape[0]} logits")
    return chosen, weights


FLOATS = (torch.float32, torch.bfloat16)  # what combine and the attention kernels take


def combine(
    outputs: list[torch.Tensor],
    slots: list[torch.Tensor | int],
    weights: torch.Tensor,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """A layer's expert combine in one call instead of five torch calls: for each of n tokens,
    the sum over its k choices (in order) of weights[t*k + j] times the output row of choice j,
    into y [n, h] of `dtype`. outputs[g] [rows, h] holds the rows of slots[g] (int64 t*k + j
    each, or one int for a one-row group). Rounded as moe.combine's torch ops round; None where
    the kernel cannot take them (it checks that the slots cover every choice once)."""
    run = kernel("moe_combine")
    n = weights.numel() // k if k else 0
    h = outputs[0].shape[-1] if outputs else 0
    rows_dtype = outputs[0].dtype if outputs else None
    if (
        run is None
        or not n
        or len(slots) != len(outputs)
        or h % 16
        or not 0 < k <= 16  # torch sums a few choices in order (tested up to 16)
        or rows_dtype not in FLOATS
        or dtype != rows_dtype
        or weights.dtype not in FLOATS
        or weights.device.type != "cpu"
        or weights.numel() != n * k
        or any(o.dtype != rows_dtype or o.dim() != 2 or o.shape[1] != h for o in outputs)
    ):
        return None
    rows = [dense(o) for o in outputs]  # held here while the kernel reads them
    held: list[torch.Tensor | ctypes.Array] = []  # each group's slots, held for the call
    for s, r in zip(slots, rows):
        if isinstance(s, int):  # a lone token's choice: no tensor (a torch call costs ~20 us)
            held.append((ctypes.c_long * 1)(s))
        elif s.dtype != torch.int64 or s.numel() != r.shape[0]:
            return None
        else:
            held.append(dense(s))
    g = len(rows)
    w = dense(weights)
    y = torch.empty(n, h, dtype=dtype)
    failed = run(
        (ctypes.c_void_p * g)(*(r.data_ptr() for r in rows)),
        (ctypes.c_void_p * g)(*(_address(t) for t in held)),
        (ctypes.c_long * g)(*(r.shape[0] for r in rows)),
        g,
        rows_dtype == torch.bfloat16,
        w.data_ptr(),
        w.dtype == torch.bfloat16,
        n,
        k,
        h,
        dtype == torch.bfloat16,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return None if failed else y


def silu_ffn(x: torch.Tensor, gate_up: object, down: object) -> torch.Tensor | None:
    """down(silu(gate) * up) of x [..., hidden] with gate|up = gate_up(x), in one kernel call
    instead of seven torch calls; None unless both weights are Panels (then torch computes it)."""
    y = silu_ffns([(x, gate_up, down)])
    return None if y is None else y[0]


def pack(weight: torch.Tensor, out: torch.Tensor) -> None:
    """`weight` [rows, in] (bfloat16, rows a multiple of PANEL) into `out`, flat, in the panels'
    layout. Rows pack independently: a weight's row blocks packed one after another into
    consecutive parts of one `out` are that weight packed (common.checkpoint packs a large one
    so, its source pages released block by block)."""
    rows, k = weight.shape
    assert weight.dtype == out.dtype == torch.bfloat16 and rows % PANEL == 0
    assert out.is_contiguous() and out.numel() == weight.numel()
    source = weight.contiguous()  # held here: a temporary would be freed before the call
    library().moe_bf16_pack(source.data_ptr(), out.data_ptr(), rows, k)


def silu_ffns(batches: Sequence[tuple[torch.Tensor, object, object]]) -> list[torch.Tensor] | None:
    """down(silu(gate) * up) of x for every (x, gate_up, down) of one layer's experts in one
    kernel call (the threads share every expert's blocks); a row's bits do not depend on the
    other rows or experts. None unless every weight is Panels (bfloat16, or common.quant's int8
    or int4) of the first expert's shapes and format (then the caller computes each)."""
    run = kernel("moe_silu_ffns")
    if run is None or not batches:
        return None
    weights = [w for _, gate_up, down in batches for w in (gate_up, down)]
    if not all(isinstance(w, Panels) for w in weights):
        return None
    first = batches[0][2]
    if any((w.format, w.group) != (first.format, first.group) for w in weights):
        return None
    hidden, inter = first.shape
    rows = [_rows(x, hidden) for x, _, _ in batches]  # held here while the kernel reads them
    if any(gu.shape != (2 * inter, hidden) or d.shape != (hidden, inter) for _, gu, d in batches):
        return None
    ys = [torch.empty(r.shape[0], hidden, dtype=torch.bfloat16) for r in rows]
    count, total = len(rows), sum(r.shape[0] for r in rows)

    def pointers(tensors: Sequence[torch.Tensor | None]) -> ctypes.Array | None:
        if tensors[0] is None:  # bfloat16 panels: no scales
            return None
        return (ctypes.c_void_p * count)(*(t.data_ptr() for t in tensors))

    if total and run(  # no rows: nothing to compute, no intermediates to allocate
        first.format,
        first.group,
        pointers(rows),
        pointers([b[1].data for b in batches]),
        pointers([b[1].scales for b in batches]),
        pointers([b[2].data for b in batches]),
        pointers([b[2].scales for b in batches]),
        pointers(ys),
        (ctypes.c_long * count)(*(r.shape[0] for r in rows)),
        count,
        inter,
        hidden,
        torch.get_num_threads(),
    ):
        raise MemoryError(f"bfloat16 kernel: no memory for {total} rows' intermediates")
    return [
        y if r is x else y.view(*x.shape[:-1], hidden) for y, r, (x, _, _) in zip(ys, rows, batches)
    ]


TILES = 5  # bf16_kernel.c's FORMAT_BF16_TILES


def _format(tiles: bool) -> int:
    return TILES if tiles and level() >= 3 else 0


class Panels:
    """A bfloat16 weight [out, in] in the kernel's layout; `panels(x, bias)` is F.linear's result.
    common.quant.QuantPanels holds int8 and int4 weights the same way (`format`, `scales`).
    `tiles`: products of 8 rows and more may run on AMX tiles where the CPU has them (level 3),
    much faster, but a row's last bits then depend on how many rows its product has: for weights
    whose products need not be batch-invariant (common.linear.prepack), not an expert's."""

    dtype = torch.bfloat16  # what it takes and returns
    device = torch.device("cpu")
    is_mkldnn = False
    format, group, scales = 0, 0, None  # bf16_kernel.c's FORMAT_BF16: no scales

    def __init__(self, weight: torch.Tensor, tiles: bool = False) -> None:
        assert fits(weight)
        self.shape = weight.shape
        self.data = torch.empty(weight.numel(), dtype=torch.bfloat16)
        pack(weight, self.data)
        self.format = _format(tiles)

    @classmethod
    def of(cls, packed: torch.Tensor, shape: tuple[int, int], tiles: bool = False) -> Panels:
        """Panels over `packed`: the `data` of an earlier Panels of a [out, in] = `shape` weight
        (mapped from a common.packcache file), used as it is. `tiles`: as Panels takes it."""
        if packed.dtype != torch.bfloat16 or packed.shape != (shape[0] * shape[1],):
            raise ValueError(
                f"packed {packed.dtype} {list(packed.shape)} is not a {list(shape)} weight's"
            )
        panels = cls.__new__(cls)
        panels.shape, panels.data = torch.Size(shape), packed
        panels.format = _format(tiles)
        return panels

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales) if t is not None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        rows = _rows(x, k)  # [m, in]; held here while the kernel reads it
        y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        if rows.shape[0]:
            b = None if bias is None else bias.float().contiguous()
            failed = library().moe_linear(  # releases the GIL, like a torch op
                self.format,
                self.group,
                rows.data_ptr(),
                self.data.data_ptr(),
                None if self.scales is None else self.scales.data_ptr(),
                None if b is None else b.data_ptr(),
                y.data_ptr(),
                rows.shape[0],
                n,
                k,
                torch.get_num_threads(),
            )
            if failed:
                raise MemoryError(f"bfloat16 kernel: no memory to widen {rows.shape[0]}x{k} inputs")
        return y if rows is x else y.view(*x.shape[:-1], n)


def call(run: Callable[..., int | None], *args: object) -> int | None:
    """Kernel function `run` on args, a tensor passed as its data pointer."""
    return run(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., width] as contiguous rows [m, width] for a kernel over bfloat16 weights."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"expected bfloat16 input for a bfloat16 weight, got {x.dtype}")
    if x.dim() == 2 and x.shape[1] == width:
        return dense(x)
    return x.reshape(-1, width).contiguous()


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` with its elements in order in memory, as the kernels read them: itself where they
    already are (mostly: a torch call costs tens of microseconds once the caches are cold)."""
    return t if t.is_contiguous() else t.contiguous()


def _address(held: torch.Tensor | ctypes.Array) -> int:
    return held.data_ptr() if isinstance(held, torch.Tensor) else ctypes.addressof(held)
