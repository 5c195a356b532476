"""Random-initialised MoE checkpoints in HuggingFace layout, for tests and CPU benchmarks.

Models are built with transformers' own classes so the files are exactly what transformers writes (plus an
optional rewrite to the fused v5 expert layout or MXFP4: expert_layouts.py), from each family's preset
(families.py), and the tokenizer is a byte-level BPE trained on a small built-in corpus so that any
UTF-8 text round-trips (bpe.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe_mesh.dev.bpe import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, tokenizer_json
from moe_mesh.dev.expert_layouts import fuse_experts, quantize_mxfp4
from moe_mesh.dev.families import (
    CLASSES,
    FAMILY_PRESETS,
    PRESET_SIZES,
    apply_router_skew,
    config_kwargs,
    init_parameters,
)

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "dbrx", "glm4_moe")
PRESETS = ("tiny", "small")
EXPERT_LAYOUTS = ("per_expert", "fused")
QUANTIZATIONS = ("mxfp4",)  # gpt-oss's published expert format


def create_checkpoint(
    out_dir: Path,
    arch: str,
    preset: str = "tiny",
    *,
    seed: int = 0,
    router_skew: float = 0.0,
    overrides: Mapping[str, Any] | None = None,
    expert_layout: str = "per_expert",
    max_shard_size: str | int | None = None,
    progress: bool = False,
    quantize: str | None = None,
) -> Path:
    """Write a random-initialised HuggingFace-layout checkpoint (config.json, safetensors, tokenizer); return out_dir.

    ``arch`` is one of ARCHS and ``preset`` one of PRESETS. The same arguments give byte-identical files.
    ``overrides`` are merged into the transformers config kwargs last (aliases such as Mixtral's ``num_experts``
    are resolved to the family's canonical field first; a dict merges into the preset's sub-config of that name,
    e.g. DBRX's ``ffn_config={"moe_top_k": 4}``).

    ``router_skew`` biases every router towards a few per-layer "hot" experts (a different, seeded set per
    layer): the expert of popularity rank r gets a gate-logit bias of ``router_skew * (1/(r+1) - mean)`` in
    units of the gate logits' per-token spread, measured on random tokens. Residual dimension 0 then becomes
    a constant routing channel that attention and MLPs neither read nor write. Share of routed slots taken by
    a layer's two hottest experts (8 experts, top-2, random tokens; uniform is 25%): skew 0 ~28-33%,
    1 ~38%, 2 ~50%, 3 ~60%, 4 ~68%, 6 ~78%.
    ``expert_layout="fused"`` stores experts as transformers v5 3-D tensors
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) instead of one tensor per
    expert (not for dbrx, whose own layout is fused). ``max_shard_size`` is passed to ``save_pretrained`` (e.g. "200MB"); ``progress`` prints stage
    messages and progress bars on stderr.
    gpt-oss stores its experts fused (``[E, H, 2I]`` with gate and up columns alternating, ``[E, I, H]``)
    whatever the layout; ``quantize="mxfp4"`` writes them as published gpt-oss checkpoints do.

    Raises ValueError for unknown arch/preset/layout or an out_dir that cannot be created, and
    FileExistsError if out_dir exists and is not empty.
    """
    for what, value, valid in (
        ("arch", arch, ARCHS),
        ("preset", preset, PRESETS),
        ("expert_layout", expert_layout, EXPERT_LAYOUTS),
    ):
        if value not in valid:
            raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(valid)}")
    if arch == "dbrx" and expert_layout == "fused":
        raise ValueError("expert_layout 'fused' is not for dbrx: its experts are fused already")
    if quantize is not None and (quantize not in QUANTIZATIONS or arch != "gpt_oss"):
        raise ValueError(f"quantize={quantize!r}: only gpt_oss has one, {', '.join(QUANTIZATIONS)}")
    if arch == "gpt_oss" and expert_layout != "per_expert":
        raise ValueError("gpt_oss experts are fused already: expert_layout applies to the others")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"output directory {out_dir} already exists and is not empty")
    # Now, not after the model is built: the nearest existing ancestor must take a directory.
    ancestor = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())
    if not (ancestor.is_dir() and os.access(ancestor, os.W_OK)):
        raise ValueError(
            f"cannot create output directory {out_dir}: {ancestor} is not a writable directory"
        )

    import torch  # here, not at module level: `moe-mesh probe` and friends must start fast
    import transformers
    from tokenizers import Tokenizer
    from transformers.utils import logging as hf_logging

    def stage(msg: str) -> None:
        if progress:
            print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)

    p = {**PRESET_SIZES[preset], **FAMILY_PRESETS.get((arch, preset), {})}
    stage(f"training byte-level BPE tokenizer (target vocab {p['vocab']})")
    tokenizer = Tokenizer.from_str(tokenizer_json(p["vocab"]))
    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[arch])
    alias = getattr(
        config_cls, "attribute_map", {}
    )  # lets an override of an alias replace the preset's field
    merged = config_kwargs(arch, p, tokenizer.get_vocab_size())
    # A nested sub-config (DBRX's attn_config, ffn_config) is merged, not replaced.
    for key, value in (overrides or {}).items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = {**merged[key], **value} if both else value
    config = config_cls(**{alias.get(k, k): v for k, v in merged.items()})
    if quantize and (config.hidden_size % 32 or config.intermediate_size % 32):
        raise ValueError(
            f"MXFP4 needs hidden_size and intermediate_size in multiples of 32, not "
            f"{config.hidden_size} and {config.intermediate_size}"
        )

    stage(f"initialising {model_cls.__name__} ({preset}, seed {seed})")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    init_parameters(model, seed)
    if router_skew:
        apply_router_skew(model, router_skew, seed)
    n_params = sum(t.numel() for t in model.parameters())
    stage(
        f"writing {n_params / 1e6:.1f}M parameters ({n_params * 4 / 2**20:.0f} MiB float32) to {out_dir}"
    )

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(
            out_dir, **({} if max_shard_size is None else {"max_shard_size": max_shard_size})
        )
    finally:
        if bars_were_on and not progress:
            hf_logging.enable_progress_bar()
    if arch == "qwen3_moe":
        # transformers 5.23 serialises Qwen3-MoE's expert count under its alias num_local_experts; published
        # Qwen3-MoE checkpoints (and parsers written against them) use num_experts, which transformers also reads.
        cfg_path = out_dir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if "num_local_experts" in cfg:
            cfg["num_experts"] = cfg.pop("num_local_experts")
            cfg_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    if expert_layout == "fused":
        stage("rewriting experts as fused 3-D tensors")
        fuse_experts(out_dir, progress)
    if quantize == "mxfp4":
        stage("quantizing experts to MXFP4")
        quantize_mxfp4(out_dir)

    stage("saving tokenizer")
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    # Written by hand rather than by transformers 5.x, whose "TokenizersBackend" class name 4.x cannot load.
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    stage("done")
    return out_dir


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _cmd_create(args: argparse.Namespace) -> int:
    try:
        out = create_checkpoint(
            Path(args.out),
            args.arch,
            args.preset,
            seed=args.seed,
            router_skew=args.router_skew,
            overrides=dict(args.override or []),
            expert_layout=args.expert_layout,
            max_shard_size=args.max_shard_size,
            progress=args.preset != "tiny",
            quantize=args.quantize,
        )
    except (FileExistsError, ValueError) as exc:
        print(f"moe-mesh checkpoint create: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the disk, not the command: full, or a path the checks above let by
        print(f"moe-mesh checkpoint create: error: writing {args.out}: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register ``checkpoint create`` on the moe-mesh CLI; ``args.func(args)`` returns the exit code."""
    checkpoint = subparsers.add_parser(
        "checkpoint", help="create random-initialised MoE checkpoints"
    )
    actions = checkpoint.add_subparsers(
        dest="checkpoint_command", required=True, metavar="{create}"
    )
    create = actions.add_parser(
        "create",
        help="write a random-initialised HuggingFace-layout MoE checkpoint",
        description="Write a random-initialised HuggingFace-layout MoE checkpoint.",
    )
    create.add_argument("--arch", required=True, choices=ARCHS)
    create.add_argument(
        "--preset",
        default="tiny",
        choices=PRESETS,
        help="tiny: unit tests; small: benchmarks (~1 GB)",
    )
    create.add_argument(
        "--out", required=True, help="output directory (must not exist or be empty)"
    )
    create.add_argument("--seed", type=int, default=0)
    create.add_argument(
        "--router-skew",
        type=float,
        default=0.0,
        help="hot-expert bias in gate-logit std units: 0 uniform, 2-4 realistic hot experts",
    )
    create.add_argument("--expert-layout", default="per_expert", choices=EXPERT_LAYOUTS)
    create.add_argument(
        "--max-shard-size",
        type=lambda s: int(s) if s.isdigit() else s,
        default=None,
        help='e.g. "200MB" or a byte count',
    )
    create.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=None,
        help="gpt_oss: store the experts in MXFP4, as published gpt-oss checkpoints do",
    )
    create.add_argument(
        "--override",
        type=_parse_override,
        action="append",
        metavar="KEY=JSON",
        help="config field override, repeatable (e.g. num_experts_per_tok=1)",
    )
    create.set_defaults(func=_cmd_create)
