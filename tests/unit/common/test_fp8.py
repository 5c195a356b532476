"""FP8 checkpoints as published: experts computed from their e4m3 bytes and block scales, other
weights dequantized at load, each equal to the format's float64 meaning; clear errors for
missing or misshapen scales."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import bf16, fp8
from common.checkpoint import Checkpoint
from common.errors import CheckpointError
from common.moe import experts_ffn
from common.quant import Quantization, QuantPanels, dequantize, unpack
from tests.support.fp8 import BLOCK, dequantize_reference, fp8_checkpoint
from tests.support.kernels import ROWS, assert_avx2_bits

pytestmark = pytest.mark.skipif(
    bf16.kernel("moe_silu_ffns") is None, reason="no C compiler or no AVX2: no FP8 kernels"
)
EXPERT = "model.layers.1.mlp.experts.0.down_proj.weight"


@pytest.fixture
def fp8_dir(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path / "cache"))
    return fp8_checkpoint(checkpoint("deepseek_v3", dtype="bfloat16"), tmp_path / "fp8")


def stored(path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_file(path / "model.safetensors")
    return tensors[name], tensors[fp8.scale_name(name)]


def test_experts_hold_the_e4m3_bytes_and_compute_the_formats_meaning(fp8_dir):
    experts = Checkpoint(fp8_dir, prepack=True, batch_invariant=True).load_experts([(1, 0), (1, 1)])
    down = experts[(1, 0)].down
    assert isinstance(down, QuantPanels) and down.quantization == Quantization("fp8", BLOCK[1])
    q, scale = stored(fp8_dir, EXPERT)
    values, scales = unpack(down.data, down.scales, tuple(down.shape), down.quantization)
    assert torch.equal(values.view(torch.uint8), q.view(torch.uint8))  # the bytes as published
    meaning = dequantize_reference(q, scale)
    assert torch.equal(dequantize(values, scales, down.quantization), meaning)
    x = torch.randn(5, meaning.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    y, ref = down(x), x.double() @ meaning.T
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()
    assert all(torch.equal(down(x[r : r + 1]), y[r : r + 1]) for r in range(5))  # batch-free bits
    h = experts[(1, 0)].gate_up.shape[1]
    rows = torch.randn(3, h, generator=torch.Generator().manual_seed(1)).bfloat16()
    together = experts_ffn([(rows, experts[(1, 0)]), (rows[:1], experts[(1, 1)])])
    assert torch.equal(together[1], experts_ffn([(rows[:1], experts[(1, 1)])])[0])


@pytest.mark.parametrize("block_k", [128, 256])
def test_blocks_of_any_width_compute_their_meaning_whatever_the_rows(block_k):
    """Blocks wider than 128 inputs included (the tiles of several rows once overflowed there)."""
    g = torch.Generator().manual_seed(4)
    q = (torch.randn(128, 512, generator=g) * 10).to(torch.float8_e4m3fn)
    scale = torch.rand(1, 512 // block_k, generator=g) + 0.5
    quant = Quantization("fp8", block_k)
    data, scales = (torch.empty(n, dtype=t) for n, t in quant.layout((128, 512)).values())
    fp8.pack(q, scale, (128, block_k), 0, data, scales)
    panels = QuantPanels.of(data, scales, (128, 512), quant)
    x = torch.randn(7, 512, generator=g).bfloat16()
    y, ref = panels(x), x.double() @ dequantize_reference(q, scale, (128, block_k)).T
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()
    assert all(torch.equal(panels(x[r : r + 1]), y[r : r + 1]) for r in range(7))


def test_products_on_avx512_give_the_avx2_kernels_bits():
    """quant_avx512.c's FP8 tiles against quant_kernel.c's, subnormal e4m3 values included."""
    g = torch.Generator().manual_seed(6)
    q = (torch.randn(192, 512, generator=g) * 10).to(torch.float8_e4m3fn)
    q[0, :64] = torch.tensor(2.0**-8).to(torch.float8_e4m3fn)  # subnormal in e4m3
    scale = torch.rand(2, 4, generator=g) + 0.5
    quant = Quantization("fp8", 128)
    data, scales = (torch.empty(n, dtype=t) for n, t in quant.layout((192, 512)).values())
    fp8.pack(q, scale, (128, 128), 0, data, scales)
    panels, bias = QuantPanels.of(data, scales, (192, 512), quant), torch.randn(192, generator=g)
    xs = [torch.randn(m, 512, generator=g).bfloat16() for m in ROWS]
    assert_avx2_bits(lambda: [panels(x, b) for x in xs for b in (None, bias)])


def test_other_fp8_weights_are_dequantized_at_load_and_float32_dequantizes_everything(fp8_dir):
    name = "model.layers.0.self_attn.o_proj.weight"
    q, scale = stored(fp8_dir, name)
    ckpt = Checkpoint(fp8_dir)
    assert ckpt.dtype == torch.bfloat16  # 'auto' for an FP8 checkpoint: what it computes in
    o = ckpt.tensor(name, tuple(q.shape))
    assert o.dtype == torch.bfloat16 and torch.equal(
        o, dequantize_reference(q, scale).float().bfloat16()
    )
    full = Checkpoint(fp8_dir, dtype=torch.float32).load_experts([(1, 0)])[(1, 0)]
    q, scale = stored(fp8_dir, EXPERT)
    assert torch.equal(full.down, dequantize_reference(q, scale).float())


def test_missing_or_misshapen_scales_and_quantizing_fp8_again_are_refused(fp8_dir):
    tensors = load_file(fp8_dir / "model.safetensors")
    scale = fp8.scale_name(EXPERT)
    for edit, message in [
        (lambda t: t.pop(scale), "missing the scales of an FP8 weight"),
        (lambda t: t.update({scale: t[scale][:1]}), r"expected float32 \[2, 3\]"),
        (lambda t: t.update({scale: t[scale].double()}), "torch.float64"),
    ]:
        broken = dict(tensors)
        edit(broken)
        save_file(broken, fp8_dir / "model.safetensors")
        with pytest.raises(CheckpointError, match=f"{message}.*{scale}"):
            Checkpoint(fp8_dir, prepack=True).load_experts([(1, 0)])
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="experts are FP8, computed as published"):
        Checkpoint(fp8_dir, prepack=True, quantize=Quantization("int8")).load_experts([(1, 0)])
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no quantization_config with quant_method 'fp8'"):
        Checkpoint(fp8_dir).load_experts([(1, 0)])
