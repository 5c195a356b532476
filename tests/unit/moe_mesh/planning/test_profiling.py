"""What `moe-mesh profile` counts as the router's weights (moe_mesh/planning/profiling.py): tensors
and the bfloat16 kernels' packed weights alike (a bfloat16 profile failed on a packed LM head)."""

from __future__ import annotations

import torch

from common import bf16
from moe_mesh.planning.profiling import _nbytes


def test_packed_and_plain_weights_are_counted() -> None:
    weight = torch.randn(64, 128).to(torch.bfloat16)
    assert _nbytes(weight) == 64 * 128 * 2
    assert _nbytes(weight.float()) == 64 * 128 * 4
    assert _nbytes(bf16.Panels(weight)) == 64 * 128 * 2
    assert _nbytes(None) == 0 and _nbytes(1e-5) == 0  # an eps, an absent bias
