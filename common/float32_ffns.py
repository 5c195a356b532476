"""A layer's float32 SiLU experts in one kernel call (common/f32_experts.c), each with the bits
expert_ffn gives it op by op.

Op by op, an expert is three float32.linear calls and two torch ops, and each product wakes the
threads anew: a decode step of 8 sequences on the Qwen3-30B-A3B slice made some 600 products of
one or two rows, and its one-row products read 20 GB/s where the same products back to back read
27-32 (host C, MKL's and f32_lanes.c's alike). The kernel takes an expert of 1 to 15 rows, on a
cache line as a new tensor's are, whose products f32_lanes.c computes with F.linear's bits
(float32.lanes_agree: per weight and where it lies, row count and thread count) and whose SiLU
torch computes in one piece: below GRAIN values, or on one thread (at::parallel_for splits more
over its threads, and a piece may end in a scalar tail through libm's expf). The first experts
of each row count and layer shape are also computed op by op and compared; a shape and row count
whose bits differed is never taken again.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence

import torch

from common import bf16, float32

log = logging.getLogger(__name__)

# An expert: its rows x [m, hidden], gate [inter, hidden], up (None: gate is gate and up joined,
# [2 inter, hidden]), down [hidden, inter]
Expert = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
MAX_ROWS = 15  # what f32_lanes.c's kernels sum as MKL does
GRAIN = 32768  # at::internal::GRAIN_SIZE: elementwise ops of fewer values run in one piece

# (hidden, inter, joined, products' threads, torch's threads, rows): whether the kernel gave
# expert_ffn's bits the first time
_verdicts: dict[tuple, bool] = {}


def silu_ffns(
    experts: Sequence[Expert | None], reference: Callable[[int], torch.Tensor]
) -> list[torch.Tensor | None]:
    """down(silu(x · gateᵀ) * (x · upᵀ)) of each expert of one layer that the kernel takes, in one
    call, and None for the rest (None entries included: the caller computes those).
    `reference(i)` is expert i computed op by op, which new row counts are held to."""
    out: list[torch.Tensor | None] = [None] * len(experts)
    run, lanes, expf8 = bf16.kernel("moe_silu_ffns_f32"), float32.torch_lanes(), float32.sleef_exp()
    first = next((e for e in experts if e is not None), None)
    if run is None or lanes is None or expf8 is None or first is None:
        return out
    hidden, inter = first[3].shape
    shape = (hidden, inter, first[2] is None, float32.team_threads(), torch.get_num_threads())
    if inter % (2 * lanes) or hidden % 16:
        return out  # a row of SiLU with no scalar tail is computed alike flat or row by row
    take = [i for i, e in enumerate(experts) if e is not None and _takes(e, shape)]
    if not take:
        return out
    chosen = [experts[i] for i in take]
    ys = [torch.empty(e[0].shape[0], hidden, dtype=torch.float32) for e in chosen]

    def pointers(tensors: Sequence[torch.Tensor]) -> ctypes.Array:
        return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))

    failed = run(
        pointers([e[0] for e in chosen]),
        pointers([e[1] for e in chosen]),
        None if shape[2] else pointers([e[2] for e in chosen]),
        pointers([e[3] for e in chosen]),
        pointers(ys),
        (ctypes.c_long * len(take))(*(e[0].shape[0] for e in chosen)),
        len(take),
        inter,
        hidden,
        expf8,
        lanes,
        shape[3],
    )
    if failed == -2:  # held below AVX-512 since the verdicts (tests)
        return out
    if failed:
        raise MemoryError(f"float32 experts: no memory for {len(take)} experts' intermediates")
    for i, y in zip(take, ys):
        key = (*shape, y.shape[0])
        if key not in _verdicts:
            _verdicts[key] = torch.equal(y, reference(i))
            if not _verdicts[key]:
                log.info("float32 experts %s: one call's bits differ from op by op's", key)
                return [None] * len(experts)
        out[i] = y
    return out


def _takes(expert: Expert, shape: tuple) -> bool:
    """Whether the kernel computes this expert with op by op's bits: plain float32 weights, which
    float32.linear computes (a new tensor's rows, as op by op's products take them), products
    f32_lanes.c sums as F.linear does at its row count, SiLU in one piece in torch, and no
    verdict against that row count."""
    x, gate, up, down = expert
    hidden, inter, joined, team, torch_threads = shape
    weights = (gate, down) if up is None else (gate, up, down)
    rows = x.shape[0] if x.dim() == 2 else 0
    return (
        all(_plain(t) for t in (x, *weights))
        and 0 < rows <= MAX_ROWS
        and (rows * inter < GRAIN or torch_threads == 1)
        and _verdicts.get((*shape, rows), True)
        and x.shape[1] == hidden
        and x.data_ptr() % 64 == 0
        and (up is None) == joined
        and gate.shape == ((2 * inter, hidden) if joined else (inter, hidden))
        and (up is None or up.shape == (inter, hidden))
        and down.shape == (hidden, inter)
        and all(float32.lanes_agree(rows, w, team) for w in weights)
    )


def _plain(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and t.dtype == torch.float32
        and t.device.type == "cpu"
        and not t.is_mkldnn
        and t.dim() == 2
        and t.is_contiguous()
    )
