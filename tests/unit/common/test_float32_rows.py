"""moe-mesh's batch-invariant float32 kernel over weights as stored: products within float32
rounding of the exact ones, a row's bits independent of its batch-mates whichever kernel computes
it, and an expert service's float32 experts left as views of the checkpoint's file."""

from __future__ import annotations

import pytest
import torch

from common import bf16
from common.checkpoint import Checkpoint
from common.float32_rows import Rows, fits
from common.moe import expert_ffn

pytestmark = pytest.mark.skipif(
    bf16.kernel("moe_f32_linear") is None, reason="no C compiler or no AVX2+FMA here"
)


@pytest.mark.parametrize(("out", "width"), [(1, 8), (13, 16), (64, 96), (130, 1024)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_are_within_float32_rounding_of_the_exact_ones(out, width, rows, with_bias):
    gen = torch.Generator().manual_seed(rows * out + width)
    w, x = torch.randn(out, width, generator=gen), torch.randn(rows, width, generator=gen)
    bias = torch.randn(out, generator=gen) if with_bias else None
    got = Rows(w)(x, bias)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    # each of 8 lanes sums width / 8 products in order, then 3 additions and the bias: every
    # step rounds once, so the error is at most (width + 4) eps times the terms' magnitudes
    scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    eps = torch.finfo(torch.float32).eps
    assert ((got.double() - exact).abs() <= (width + 4) * eps * scale).all()


def test_a_row_gets_the_same_bits_whatever_its_batch_mates():
    gen = torch.Generator().manual_seed(0)
    # 254 columns: one row computes the last 6 alone (past its blocks of 8), several rows the
    # first 4 of them in blocks of 4: every kernel meets every other on some column
    w = Rows(torch.randn(254, 512, generator=gen))
    x = torch.randn(40, 512, generator=gen)
    batch = w(x)
    for size in (1, 2, 3, 4, 5, 7, 9):  # every mix of the 1-, 2- and 3-row kernels
        for start in (0, 6, 40 - size):
            assert torch.equal(w(x[start : start + size]), batch[start : start + size])


def test_inputs_of_any_leading_shape_multiply_and_what_it_cannot_take_is_refused():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 40, generator=gen)
    x = torch.randn(2, 3, 40, generator=gen)
    assert torch.equal(Rows(w)(x), Rows(w)(x.reshape(6, 40)).view(2, 3, 64))
    assert Rows(w).nbytes == 64 * 40 * 4 and Rows(w).data is w  # used as it is
    assert Rows(w)(torch.empty(0, 40)).shape == (0, 64)
    assert not fits((64, 36)) and not fits((64,)) and fits((1, 8))
    with pytest.raises(ValueError, match="not float32 rows"):
        Rows(torch.randn(64, 36))
    with pytest.raises(ValueError, match="not float32 rows"):
        Rows(w.bfloat16())
    with pytest.raises(TypeError, match="expected float32 input"):
        Rows(w)(x.bfloat16())


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_an_expert_services_float32_experts_stay_views_of_the_file(checkpoint, monkeypatch, arch):
    """Mixtral stores gate and up apart (two views), Qwen back to back (one view of both)."""
    monkeypatch.delenv("MOE_MESH_PREPACK", raising=False)
    path = checkpoint(arch)  # float32
    service = Checkpoint(path, prepack=True, batch_invariant=True)
    held = service.load_experts([(1, 2)])[(1, 2)]
    plain = Checkpoint(path).load_experts([(1, 2)])[(1, 2)]  # views, F.linear's products
    parts = [held.gate_up, held.down] + ([held.up] if held.up is not None else [])
    assert all(isinstance(p, Rows) for p in parts)
    assert service._stored([p.data for p in parts])  # the file's pages, not a copy
    assert (held.up is None) == (arch == "qwen3_moe")
    x = torch.randn(5, service.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(expert_ffn(x, held), expert_ffn(x, plain), rtol=1e-5, atol=1e-6)
