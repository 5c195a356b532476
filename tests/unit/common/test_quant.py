"""int8 and int4 experts: the format's reference arithmetic, row independence, one fused call,
the packed-weight cache, and clear errors for what cannot be quantized."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from common import bf16
from common.checkpoint import Checkpoint
from common.errors import CheckpointError, UnsupportedModelError
from common.moe import experts_ffn
from common.quant import Quantization, QuantPanels, dequantize, quantize, unpack
from tests.support.kernels import ROWS, assert_avx2_bits

pytestmark = pytest.mark.skipif(
    bf16.kernel("moe_silu_ffns") is None, reason="no C compiler or no AVX2: no quantized kernels"
)
FORMATS = [Quantization("int8"), *(Quantization("int4", g) for g in (32, 64, 128))]


def weight(out: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(out, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[1, :] = 0  # an all-zero row: scale 0, values 0
    w[2, 7] = 0.9  # an outlier: one value sets its group's (or row's) scale
    return w


def reference(x: torch.Tensor, p: QuantPanels) -> torch.Tensor:
    """x times the dequantized weight, in float64: what the format means."""
    values, scales = unpack(p.data, p.scales, tuple(p.shape), p.quantization)
    return x.double() @ dequantize(values, scales, p.quantization).T


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_quantizer_follows_the_formats_rule(q, dtype):
    w = weight(128, 256).to(dtype)
    p = QuantPanels(w, q)
    values, scales = unpack(p.data, p.scales, (128, 256), q)
    expected_values, expected_scales = quantize(w, q)
    assert torch.equal(values, expected_values) and torch.equal(scales, expected_scales)
    lo, hi = (-127, 127) if q.scheme == "int8" else (-8, 7)
    assert values.min() >= lo and values.max() <= hi and values[1].abs().sum() == 0
    error = (dequantize(values, scales, q) - w.double()).abs().max()
    assert error <= scales.double().abs().max() / 2 + 1e-6  # within half a step of the grid


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_a_product_is_the_formats_reference_arithmetic_to_float_accuracy(q, rows):
    p = QuantPanels(weight(192, 512), q)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    y, ref = p(x), reference(x, p)
    # float32 sums of exact products, then one rounding to bfloat16 (half an ulp: 2^-9 relative)
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()


@pytest.mark.parametrize("k", [72, 96, 192, 320])
def test_int8_of_any_width_is_the_reference_arithmetic(k):
    """int8's input groups are the largest of 128, 64 and 32 inputs dividing k (int_dot.c); a k
    that none divides (72) is computed by the float kernels instead."""
    p = QuantPanels(weight(64, k), Quantization("int8"))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    y, ref = p(x), reference(x, p)
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()
    assert torch.equal(p(x[1:2]), y[1:2])


@pytest.mark.parametrize(
    "q", [Quantization("int8"), Quantization("int4", 64)], ids=lambda q: q.name
)
def test_inputs_of_any_range_give_the_reference_and_a_nan_spreads_only_to_its_row(q):
    """int4's inputs, and int8's where the CPU has VNNI and VBMI, become integers per group
    (int_dot.c): tiny, huge, zero and mixed groups keep the reference's accuracy; a NaN or an
    infinity makes its row NaN, and only its row."""
    p = QuantPanels(weight(128, 256), q)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 256, generator=gen)
    x[0] *= 1e-30  # about 2^-100: below it a group is computed on 2^-122's grid
    x[1] *= 1e30
    x[2, :128] = 0  # a group of zeros (int8's hold 128 inputs here)
    x[3, ::7] *= 2.0**-20  # inputs far below their group's largest, rounded to its grid
    x = x.bfloat16()
    y, ref = p(x), reference(x, p)
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5 * ref.abs().amax(1, True)).all()
    integers = q.scheme == "int4" or bf16.kernel("moe_int8_dot")(p.shape[1])  # VNNI and VBMI
    for bad in (float("nan"), float("inf")):
        z = x.clone()
        z[4, 70] = bad
        out = p(z)
        # int8's float kernels: an infinity times each weight, NaN where the weight is 0
        assert out[4].isnan().all() if integers else not out[4].isfinite().any()
        assert torch.equal(out[[0, 1, 2, 3, 5]], y[[0, 1, 2, 3, 5]])


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.name)
def test_a_rows_bits_do_not_depend_on_its_batch_mates(q):
    p = QuantPanels(weight(128, 256), q)
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    whole = p(x)  # tiles of 5, 4 and 4 rows; below, row kernels (1, 2 rows) and tiles of 3 to 6
    for start, stop in [(0, 1), (1, 3), (3, 6), (6, 13), (0, 12)]:
        assert torch.equal(p(x[start:stop]), whole[start:stop])


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.name)
def test_products_on_avx512_give_the_avx2_kernels_bits(q):
    """quant_avx512.c's row kernels and tiles against quant_kernel.c's, at one row, a pair, tiles
    of every width, and two and three tiles' worth, a bias and many groups included. int8's at
    level 2: where the CPU has VNNI and VBMI, the full level computes int8 as integer dot
    products, whose bits are that CPU's own (int_dot.c)."""
    gen = torch.Generator().manual_seed(4)
    p, bias = QuantPanels(weight(192, 2048), q), torch.randn(192, generator=gen)
    xs = [torch.randn(m, 2048, generator=gen).bfloat16() for m in ROWS]
    level = 2 if q.scheme == "int8" else 3
    assert_avx2_bits(lambda: [p(x, b) for x in xs for b in (None, bias)], level)


@pytest.mark.parametrize(
    "q", [Quantization("int8"), Quantization("int4", 32)], ids=lambda q: q.name
)
def test_a_layers_experts_in_one_call_equal_each_alone_and_the_reference(
    q, checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path / "cache"))
    path = checkpoint("mixtral", dtype="bfloat16")
    ckpt = Checkpoint(path, prepack=True, batch_invariant=True, quantize=q)
    experts = ckpt.load_experts([(0, e) for e in range(4)])
    assert all(isinstance(w.gate_up, QuantPanels) for w in experts.values())
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    batches = [(x[e : e + 1 + e], w) for (_, e), w in experts.items()]
    together = experts_ffn(batches)
    for (rows, w), y in zip(batches, together):
        assert torch.equal(experts_ffn([(rows, w)])[0], y)
        gate_up = reference(rows, w.gate_up).float().bfloat16()
        gate, up = gate_up.chunk(2, dim=-1)
        expected = reference(F.silu(gate) * up, w.down)
        assert ((y.double() - expected).abs() <= expected.abs() * 2**-7 + 1e-3).all()


def test_quantized_experts_are_packed_once_and_mapped_after(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path / "cache"))
    path = shutil.copytree(checkpoint("mixtral", dtype="bfloat16"), tmp_path / "ckpt")
    q = Quantization("int4", 32)
    first = Checkpoint(path, prepack=True, quantize=q).load_experts([(1, 2)])[(1, 2)]
    (file,) = (tmp_path / "cache" / "packed").glob("*/layer1-expert2-int4-g32.safetensors")
    built = file.stat().st_mtime_ns
    again = Checkpoint(path, prepack=True, quantize=q).load_experts([(1, 2)])[(1, 2)]
    assert file.stat().st_mtime_ns == built  # mapped, not packed again
    assert torch.equal(first.down.data, again.down.data)
    assert torch.equal(first.gate_up.scales, again.gate_up.scales)
    # int4 at group 32: half a byte a weight and a bfloat16 scale a group
    assert again.nbytes == 3 * 64 * 96 // 2 + 3 * 64 * 96 // 32 * 2


def test_what_cannot_be_quantized_is_refused_naming_the_tensor_and_the_field(checkpoint):
    path = checkpoint("mixtral", dtype="bfloat16")
    with pytest.raises(CheckpointError, match=r"quantize_group_size 64 does not divide .* 96.*w2"):
        Checkpoint(path, quantize=Quantization("int4", 64)).load_experts([(0, 0)])
    with pytest.raises(CheckpointError, match=r"served in torch.float32: set dtype bfloat16"):
        Checkpoint(checkpoint("mixtral"), quantize=Quantization("int8")).load_experts([(0, 0)])
    with pytest.raises(UnsupportedModelError, match="not offered for gpt_oss"):
        gpt = checkpoint("gpt_oss", dtype="bfloat16")
        Checkpoint(gpt, quantize=Quantization("int8")).load_experts([(0, 0)])
    with pytest.raises(ValueError, match="quantize_group_size: 48 is not one of"):
        Quantization("int4", 48)
    with pytest.raises(ValueError, match="'int3' is not one of"):
        Quantization("int3")  # type: ignore[arg-type]


def test_dense_layers_quantize_too_when_asked_but_never_the_gates(
    checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path / "cache"))
    path = checkpoint("mixtral", dtype="bfloat16")
    q = Quantization("int8")
    dense = Checkpoint(path, prepack=True, quantize=q, quantize_dense=True).load_dense()
    layer = dense.layers[0]
    assert isinstance(layer.attention.qkv, QuantPanels) and isinstance(
        layer.attention.o, QuantPanels
    )
    assert isinstance(dense.lm_head, QuantPanels) and dense.lm_head.quantization == q
    assert isinstance(layer.router, torch.Tensor)  # routing decisions stay in bfloat16
    plain = Checkpoint(path, prepack=True, quantize=q).load_dense()
    assert not isinstance(plain.layers[0].attention.o, QuantPanels)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    ref = reference(x, layer.attention.o)
    assert ((layer.attention.o(x).double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()
