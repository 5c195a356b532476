"""Rewrites of a saved checkpoint's experts: the fused transformers v5 layout, and MXFP4."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_PER_EXPERT = re.compile(
    r"^(.+?)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_ROLE = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


def fuse_experts(out_dir: Path, progress: bool) -> None:
    """Rewrite per-expert tensors as transformers v5 fused ``experts.gate_up_proj`` / ``experts.down_proj``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    with (
        safe_open(out_dir / "model.safetensors", "pt")
        if index is None
        else contextlib.nullcontext() as f
    ):
        old_map = index["weight_map"] if index else dict.fromkeys(f.keys(), "model.safetensors")
    new_map: dict[str, str] = {}  # new key -> file
    # new key -> old key, or the [gate, up, down] per-expert key lists
    sources: dict[str, list[str] | str] = {}
    experts: dict[str, dict[tuple[str, int], str]] = {}
    for key in old_map:
        if m := _PER_EXPERT.match(key):
            experts.setdefault(m[1], {})[(_ROLE[m[3]], int(m[2]))] = key
        else:  # Mixtral's block_sparse_moe is mlp in v5; renaming keeps the whole layer under one prefix
            new_key = key.replace(".block_sparse_moe.", ".mlp.")
            new_map[new_key], sources[new_key] = old_map[key], key
    for prefix, parts in experts.items():
        n = 1 + max(e for _, e in parts)
        # Fused tensors go to the shard that held expert 0's gate, so shards stay near max_shard_size.
        home = old_map[parts[("gate", 0)]]
        for name, roles in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            new_map[f"{prefix}.mlp.experts.{name}"] = home
            sources[f"{prefix}.mlp.experts.{name}"] = [
                parts[(r, e)] for e in range(n) for r in roles
            ]
    files = sorted(set(old_map.values()))
    # A shard that held only expert slices homed elsewhere ends up empty: drop it and renumber the rest.
    kept = [f for f in files if f in new_map.values()]
    renamed = {
        f: f if index is None else f"model-{i:05d}-of-{len(kept):05d}.safetensors"
        for i, f in enumerate(kept, 1)
    }
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(out_dir / f, "pt")) for f in files}

        def load(old_key: str) -> torch.Tensor:
            return handles[old_map[old_key]].get_tensor(old_key)

        for fname in tqdm(kept, desc="Fusing experts", disable=not progress, file=sys.stderr):
            tensors = {}
            for new_key in (k for k, f in new_map.items() if f == fname):
                src = sources[new_key]
                if isinstance(src, str):
                    tensors[new_key] = load(src)
                # [E, 2I, H]: gate rows then up rows per expert.
                elif new_key.endswith("gate_up_proj"):
                    pairs = zip(src[::2], src[1::2])
                    tensors[new_key] = torch.stack(
                        [torch.cat([load(g), load(u)]) for g, u in pairs]
                    )
                else:  # [E, H, I]
                    tensors[new_key] = torch.stack([load(k) for k in src])
            save_file(tensors, out_dir / (renamed[fname] + ".tmp"), metadata={"format": "pt"})
    for fname in files:
        (out_dir / fname).unlink()
    for fname in kept:
        os.replace(out_dir / (renamed[fname] + ".tmp"), out_dir / renamed[fname])
    if index is not None:
        index["weight_map"] = {k: renamed[f] for k, f in sorted(new_map.items())}
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def quantize_mxfp4(out_dir: Path) -> None:
    """Rewrite gpt-oss's float experts as published: ``*_blocks`` / ``*_scales`` in MXFP4 with rows
    of [E, 2I, H] and [E, H, I] (transformers keeps [E, H, 2I] and [E, I, H]), biases as they are,
    and a ``quantization_config`` in config.json."""
    from common import mxfp4

    def rewrite(tensors: dict) -> dict[str, list[str]]:
        held = {}
        for name in [
            n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        ]:
            blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            held[name] = [name + "_blocks", name + "_scales"]
        return held

    config = {  # what openai/gpt-oss-20b's config.json says
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    _rewrite_tensors(out_dir, rewrite, config)


def dequantize_mxfp4(out_dir: Path) -> None:
    """`quantize_mxfp4` undone: MXFP4 experts rewritten as gpt-oss's float checkpoints store them
    ([E, H, 2I] and [E, I, H], bfloat16), each weight exactly the value its code and scale mean,
    and no ``quantization_config``: the same model, stored unquantized (bench/mxfp4.py's
    baseline)."""
    import torch

    from common import mxfp4

    def rewrite(tensors: dict) -> dict[str, list[str]]:
        held = {}
        for name in [n for n in tensors if n.endswith("experts.gate_up_proj_blocks")] + [
            n for n in tensors if n.endswith("experts.down_proj_blocks")
        ]:
            base = name.removesuffix("_blocks")
            scales = tensors.pop(base + "_scales")
            w = mxfp4.dequantize(tensors.pop(name), scales, torch.bfloat16)
            tensors[base] = w.transpose(1, 2).contiguous()
            held[name], held[base + "_scales"] = [base], [base]
        return held

    _rewrite_tensors(out_dir, rewrite, None)


def quantize_fp8(out_dir: Path, block: tuple[int, int] = (128, 128)) -> None:
    """Rewrite a checkpoint's linear layers as DeepSeek-V3 publishes them: each `W.weight` of a
    decoder layer (not the routers' gates, norms, embeddings or LM head) as float8_e4m3fn with
    `W.weight_scale_inv`, float32 per block of `block` = (rows, inputs), the block's largest
    magnitude over 448 (e4m3's largest value), and `quantization_config` in config.json."""

    def rewrite(tensors: dict) -> dict[str, list[str]]:
        held = {}
        for name in [n for n in tensors if _fp8_quantized(n, tensors[n])]:
            weight, scale = _fp8_blocks(tensors.pop(name).float(), block)
            tensors[name], tensors[name + "_scale_inv"] = weight, scale
            held[name] = [name, name + "_scale_inv"]
        return held

    config = {  # what deepseek-ai/DeepSeek-V3's config.json says
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    _rewrite_tensors(out_dir, rewrite, config)


def _rewrite_tensors(
    out_dir: Path,
    rewrite: Callable[[dict], dict[str, list[str]]],
    quantization_config: dict | None,
) -> None:
    """Each safetensors file of `out_dir` through `rewrite` (which edits its tensors in place and
    returns, for each tensor it replaced, the names that hold it now), the index following, and
    `quantization_config` written into config.json (None: removed from it)."""
    from safetensors.torch import load_file, save_file

    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    for fname in files:
        tensors = load_file(out_dir / fname)
        for name, names in rewrite(tensors).items():
            if index:
                shard = index["weight_map"].pop(name)
                index["weight_map"].update(dict.fromkeys(names, shard))
        save_file(tensors, out_dir / (fname + ".tmp"), metadata={"format": "pt"})
        os.replace(out_dir / (fname + ".tmp"), out_dir / fname)
    if index:
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if quantization_config is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = quantization_config
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _fp8_quantized(name: str, tensor) -> bool:
    routers = (".gate.weight", "shared_expert_gate.weight", ".router.weight")
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and not name.endswith(routers)
    )


def _fp8_blocks(w, block: tuple[int, int]):
    """(e4m3 weight, float32 scales [ceil(out / br), ceil(in / bk)]): DeepSeek's reference rule."""
    import torch

    (out, k), (br, bk) = w.shape, block
    rows, cols = -(-out // br), -(-k // bk)
    padded = torch.zeros(rows * br, cols * bk)
    padded[:out, :k] = w
    blocks = padded.view(rows, br, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / safe[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(rows * br, cols * bk)[:out, :k].contiguous(), scale
