"""gpt-oss: what its config means, its loading hooks (float and MXFP4 experts, read selectively),
its router and experts against transformers' modules, and errors that name the culprit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from common import bf16, mxfp4
from common.arch import parse_spec
from common.checkpoint import Checkpoint
from common.errors import CheckpointError, UnsupportedModelError
from common.moe import expert_ffn, route
from common.quant import QuantPanels
from common.safetensors_mmap import SafetensorsFile
from tests.support.hf import load

EXPERTS = "model.layers.1.mlp.experts."


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_parse_reads_every_gpt_oss_field(checkpoint) -> None:
    spec = Checkpoint(checkpoint("gpt_oss")).spec
    assert (spec.router, spec.router_bias, spec.expert_bias, spec.attention_sinks) == (
        "topk_softmax",
        True,
        True,
        True,
    )
    assert (spec.qkv_bias, spec.o_bias, spec.qk_norm, spec.combine_in_fp32) == (
        True,
        True,
        "none",
        False,
    )
    assert (spec.activation.kind, spec.activation.alpha, spec.activation.limit) == (
        "clamped_swiglu",
        1.702,
        7.0,
    )
    assert spec.sliding_window == 16 and [spec.is_sliding(i) for i in range(3)] == [
        True,
        False,
        True,
    ]
    assert (spec.rope.scaling, spec.rope.factor, spec.rope.truncate, spec.rope_theta) == (
        "yarn",
        8.0,
        False,
        150000.0,
    )
    assert spec.expert_params == 3 * 64 * 96 + 2 * 96 + 64  # with the biases


def test_parse_defaults_and_variants(checkpoint) -> None:
    config = _config(checkpoint("gpt_oss"))
    del config["layer_types"], config["attention_bias"]  # transformers' defaults
    config.update(swiglu_limit=3.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    spec = parse_spec(config)
    assert spec.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert spec.qkv_bias and spec.o_bias and spec.activation.limit == 3.5
    assert spec.rope.scaling == "default" and spec.rope_theta == 1e4
    config.update(attention_bias=False, layer_types=["full_attention"] * 3, sliding_window=None)
    spec = parse_spec(config)
    assert not spec.qkv_bias and not spec.o_bias and not any(map(spec.is_sliding, range(3)))


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        ({"layer_types": ["full_attention"] * 2}, CheckpointError, "layer_types must list 3"),
        ({"layer_types": ["chunked_attention"] * 3}, CheckpointError, "chunked_attention"),
        ({"sliding_window": None}, CheckpointError, "sliding_window=None"),
        ({"sliding_window": 0}, CheckpointError, "sliding_window=0"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            UnsupportedModelError,
            "quant_method='fp8'",
        ),
        ({"num_local_experts": None}, CheckpointError, "num_local_experts"),
    ],
)
def test_config_errors_name_the_field_and_the_file(checkpoint, edit, error, message) -> None:
    config = {**_config(checkpoint("gpt_oss")), **edit}
    with pytest.raises(error, match=message) as e:
        parse_spec(config, "/ckpt/config.json")
    assert "/ckpt/config.json" in str(e.value)


def test_router_and_experts_compute_what_transformers_does(checkpoint) -> None:
    """Our route + expert_ffn on loaded weights against GptOssTopKRouter and GptOssExperts."""
    path = checkpoint("gpt_oss")
    ckpt = Checkpoint(path)
    layer = ckpt.load_dense().layers[1]
    experts = ckpt.load_experts(ckpt.all_expert_pairs())
    mlp = load(path).model.layers[1].mlp
    x = torch.randn(9, 64)
    with torch.no_grad():
        _, want_w, want_e = mlp.router(x)
        want = mlp.experts(x, want_e, want_w)
    r = route(x, layer.router, ckpt.spec, layer.router_bias)
    assert torch.equal(r.experts, want_e) and torch.equal(r.weights, want_w)
    ours = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(r.experts[t].tolist(), r.weights[t]):
            ours[t] += w * expert_ffn(x[t : t + 1], experts[(1, e)])[0]
    assert (ours - want).abs().max() < 1e-6


def test_float_experts_are_deinterleaved_gate_rows_first(checkpoint) -> None:
    path = checkpoint("gpt_oss")
    stored = load_file(path / "model.safetensors")
    [w] = Checkpoint(path).load_experts([(1, 5)]).values()
    gate_up = stored[EXPERTS + "gate_up_proj"][5]  # [H, 2I]: gate, up, gate, up, ... columns
    bias = stored[EXPERTS + "gate_up_proj_bias"][5]
    assert torch.equal(w.gate_up, torch.cat([gate_up[:, 0::2].T, gate_up[:, 1::2].T]))
    assert torch.equal(w.gate_up_bias, torch.cat([bias[0::2], bias[1::2]]))
    assert torch.equal(w.down, stored[EXPERTS + "down_proj"][5].T)
    assert torch.equal(w.down_bias, stored[EXPERTS + "down_proj_bias"][5])
    assert bias.abs().min() > 0  # the test checkpoint's biases are not transformers' zeros


@pytest.fixture
def touched(monkeypatch) -> list[str]:
    names: list[str] = []
    original = SafetensorsFile.get

    def spy(self, name):
        names.append(name)
        return original(self, name)

    monkeypatch.setattr(SafetensorsFile, "get", spy)
    return names


@pytest.mark.parametrize("quantize", [None, "mxfp4"])
def test_an_expert_subset_reads_only_its_layers_expert_tensors(checkpoint, touched, quantize):
    ckpt = Checkpoint(checkpoint("gpt_oss", quantize=quantize))
    ckpt.load_experts([(1, 3), (1, 6)])
    assert touched and all(n.startswith(EXPERTS) for n in touched), touched
    assert any(n.endswith("_blocks") for n in touched) == (quantize == "mxfp4")
    touched.clear()
    dense = ckpt.load_dense()
    assert touched and not any("experts" in n for n in touched)
    assert dense.layers[0].attention.sinks.abs().max() > 0.1  # O(1), unlike transformers' init


def test_mxfp4_experts_load_as_transformers_dequantizes_them(checkpoint) -> None:
    path = checkpoint("gpt_oss", quantize="mxfp4")
    stored = load_file(path / "model.safetensors")
    assert stored[EXPERTS + "gate_up_proj_blocks"].shape == (8, 192, 2, 16)
    assert stored[EXPERTS + "down_proj_scales"].shape == (8, 64, 3)
    assert _config(path)["quantization_config"]["quant_method"] == "mxfp4"
    for dtype in (torch.float32, torch.bfloat16):
        [w] = Checkpoint(path, dtype=dtype).load_experts([(1, 2)]).values()
        gate_up = convert_moe_packed_tensors(
            stored[EXPERTS + "gate_up_proj_blocks"],
            stored[EXPERTS + "gate_up_proj_scales"],
            dtype=dtype,
        )[2]  # [H, 2I], as transformers holds it
        down = convert_moe_packed_tensors(
            stored[EXPERTS + "down_proj_blocks"], stored[EXPERTS + "down_proj_scales"], dtype=dtype
        )[2]  # [I, H]
        assert w.gate_up.dtype == dtype
        assert torch.equal(w.gate_up, torch.cat([gate_up[:, 0::2].T, gate_up[:, 1::2].T]))
        assert torch.equal(w.down, down.T)


@pytest.mark.skipif(bf16.kernel("moe_linear") is None, reason="no C compiler or AVX2: dequantized")
def test_mxfp4_experts_served_in_bfloat16_are_computed_from_their_codes(
    checkpoint, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path))
    path = checkpoint("gpt_oss", quantize="mxfp4")
    [plain] = Checkpoint(path, dtype=torch.bfloat16).load_experts([(1, 2)]).values()
    [held] = Checkpoint(path, dtype=torch.bfloat16, prepack=True).load_experts([(1, 2)]).values()
    assert isinstance(held.gate_up, QuantPanels) and held.down.quantization.name == "mxfp4"
    # Packed once a host: the next process maps the cache file and reads no code
    monkeypatch.setattr(mxfp4, "pack", lambda *a: pytest.fail("packed again"))
    [again] = Checkpoint(path, dtype=torch.bfloat16, prepack=True).load_experts([(1, 2)]).values()
    assert torch.equal(again.gate_up.data, held.gate_up.data)
    assert torch.equal(again.down.scales, held.down.scales)
    assert held.gate_up.nbytes == 192 * 64 // 2 + 192 * 2 * 2  # codes and a scale a block
    # The dequantized weights' FFN (gate rows first) to within a bfloat16 rounding: the products
    # are exact in both, only their float32 sums differ in order
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    want, got = expert_ffn(x, plain).double(), expert_ffn(x, held).double()
    assert ((got - want).abs() <= (want.abs() + want.abs().max()) * 2**-7).all()
    [f32] = Checkpoint(path, dtype=torch.float32, prepack=True).load_experts([(1, 2)]).values()
    assert not isinstance(f32.gate_up, QuantPanels)  # float32: dequantized, token-exact


# -- broken checkpoints ----------------------------------------------------------------------------


@pytest.fixture(params=[None, "mxfp4"])
def broken(request, checkpoint, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("gpt_oss", quantize=request.param), dst)
    return dst


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _load_all(path: Path) -> None:
    ckpt = Checkpoint(path)
    ckpt.load_dense()
    ckpt.load_experts(ckpt.all_expert_pairs())


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.2.self_attn.sinks",
        "model.layers.0.mlp.router.bias",
        "model.layers.2.mlp.experts.down_proj_bias",
        "model.layers.1.self_attn.o_proj.bias",
    ],
)
def test_missing_tensor_is_named(broken, name) -> None:
    _rewrite(broken, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        _load_all(broken)
    assert name in str(e.value) and str(broken) in str(e.value)


def test_missing_expert_weights_are_named_in_the_layout_at_hand(broken) -> None:
    quantized = "quantization_config" in _config(broken)
    name = EXPERTS + ("gate_up_proj_scales" if quantized else "gate_up_proj")
    _rewrite(broken, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        _load_all(broken)
    assert repr(name) in str(e.value)


def test_wrong_shape_of_the_sinks_names_both_shapes(broken) -> None:
    name = "model.layers.0.self_attn.sinks"
    _rewrite(broken, lambda t: t.update({name: torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"wrong shape \[3\], config implies \[4\]") as e:
        _load_all(broken)
    assert name in str(e.value) and "model.safetensors" in str(e.value)


def test_mxfp4_codes_of_the_wrong_dtype_or_shape_are_named(checkpoint, tmp_path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("gpt_oss", quantize="mxfp4"), path)
    blocks, scales = EXPERTS + "down_proj_blocks", EXPERTS + "down_proj_scales"
    _rewrite(path, lambda t: t.update({blocks: t[blocks].float()}))
    with pytest.raises(
        CheckpointError, match="wrong dtype torch.float32, expected torch.uint8"
    ) as e:
        _load_all(path)
    assert blocks in str(e.value)
    _rewrite(
        path, lambda t: t.update({blocks: t[blocks].byte(), scales: t[scales][:, :, :2].clone()})
    )
    with pytest.raises(
        CheckpointError, match=r"wrong shape \[8, 64, 2\], config implies \[8, 64, 3\]"
    ):
        _load_all(path)


def test_mxfp4_rows_must_be_whole_blocks(checkpoint, tmp_path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("gpt_oss", quantize="mxfp4"), path)
    config = _config(path)
    config["intermediate_size"] = 80  # down_proj rows of 80 weights: 2.5 blocks
    (path / "config.json").write_text(json.dumps(config))
    gate_up = [  # every layer's: the header check (common/arch/shapes.py) sees them all
        f"model.layers.{i}.mlp.experts.gate_up_proj{n}"
        for i in range(config["num_hidden_layers"])
        for n in ("_bias", "_blocks", "_scales")
    ]
    # 2 * 80 rows: the gate and up projections agree with the config, the down one cannot.
    _rewrite(path, lambda t: t.update({n: t[n][:, :160].clone() for n in gate_up}))
    with pytest.raises(CheckpointError, match="multiple of 32 weights; the config implies 80"):
        Checkpoint(path).load_experts([(0, 0)])
