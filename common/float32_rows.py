"""float32 weights as stored, for an expert service's batch-invariant products (f32_kernel.c).

An expert service merges its callers' rows into one batch, so a row's result must not depend on
its batch-mates. MKL's small-batch products do not keep that. oneDNN's prepacked ones do, but
its layout is a copy each process makes, so two replicas held two copies of every float32 expert.
The kernel reads the weight as the checkpoint stores it, [out, in] row by row, so the weights
stay views of the file and every process on a host shares its pages. Each output is a dot
product in one fixed order (f32_kernel.c): the bits are not F.linear's (the router's float32
stays F.linear's, which transformers computes) but are the same whatever the batch.

Expert services use it wherever it runs (common.linear.float32_as_stored says why that is not
measured at start-up); MOE_MESH_PREPACK=on keeps oneDNN's layout.
"""

from __future__ import annotations

import torch

from common import bf16

LANES = 8  # an input width must be a multiple: the kernel sums 8 lanes, no tail


class Rows:
    """A float32 weight [out, in] used as stored; `rows(x, bias)` is x·Wᵀ + bias."""

    dtype = torch.float32  # what it takes and returns
    device = torch.device("cpu")
    is_mkldnn = False

    def __init__(self, weight: torch.Tensor) -> None:
        if not (weight.dtype == torch.float32 and fits(tuple(weight.shape))):
            raise ValueError(f"a {weight.dtype} {list(weight.shape)} weight is not float32 rows")
        self.shape = weight.shape
        self.data = weight.contiguous()  # a view of the file stays one

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        if x.dtype != torch.float32:
            raise TypeError(f"expected float32 input for a float32 weight, got {x.dtype}")
        rows = bf16.dense(x.reshape(-1, k))  # held here while the kernel reads it
        y = torch.empty(rows.shape[0], n, dtype=torch.float32)
        if rows.shape[0]:
            b = None if bias is None else bias.float().contiguous()
            bf16.kernel("moe_f32_linear")(  # releases the GIL, like a torch op
                rows.data_ptr(),
                self.data.data_ptr(),
                None if b is None else b.data_ptr(),
                y.data_ptr(),
                rows.shape[0],
                n,
                k,
                torch.get_num_threads(),
            )
        return y.view(*x.shape[:-1], n)


def fits(shape: tuple[int, ...]) -> bool:
    """Whether a weight [out, in] of `shape` can be held as Rows: `in` a multiple of LANES."""
    return len(shape) == 2 and shape[0] > 0 and shape[1] > 0 and shape[1] % LANES == 0
