"""FP8 checkpoints in DeepSeek-V3's published layout, built from a test checkpoint, and their
float64-dequantized twins: the reference an FP8 checkpoint's outputs are held to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_mesh.dev.expert_layouts import quantize_fp8

# Blocks of 32 x 32: the tiny presets' widths (64, 96) are not multiples of DeepSeek's 128.
BLOCK = (32, 32)


def fp8_checkpoint(source: Path, out: Path, block: tuple[int, int] = BLOCK) -> Path:
    """`source` copied to `out` with its decoder layers' linear weights in FP8 (cached: kept)."""
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        quantize_fp8(tmp, block)
        tmp.rename(out)
    return out


def dequantized(fp8_dir: Path, out: Path) -> Path:
    """`fp8_dir` with every FP8 weight replaced by value times scale (in float64, stored as
    float32, as exact as float32 holds it) and everything else in float32: what the FP8 weights
    mean, for transformers and our float32 engine."""
    if (out / "config.json").exists():
        return out
    block = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    br, bk = block["weight_block_size"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(fp8_dir, tmp)
    tensors = load_file(tmp / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        scale = tensors.pop(name).double()
        weight = name.removesuffix("_scale_inv")
        q = tensors[weight].double()
        s = scale.repeat_interleave(br, 0)[: q.shape[0]].repeat_interleave(bk, 1)[:, : q.shape[1]]
        tensors[weight] = q * s
    save_file({n: t.float() for n, t in tensors.items()}, tmp / "model.safetensors")
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.rename(out)
    return out


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """An FP8 weight's meaning in float64."""
    br, bk = block
    s = scale.double().repeat_interleave(br, 0)[: q.shape[0]].repeat_interleave(bk, 1)
    return q.double() * s[:, : q.shape[1]]
