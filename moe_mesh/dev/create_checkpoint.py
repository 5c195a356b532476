"""Random-initialised (optionally briefly trained) MoE checkpoints in HuggingFace layout, for tests
and CPU benchmarks.

Models are built with transformers' own classes so the files are exactly what transformers writes (plus an
optional rewrite to the fused v5 expert layout or MXFP4: expert_layouts.py), from each family's preset
(families.py), and the tokenizer is a byte-level BPE trained on a small built-in corpus so that any
UTF-8 text round-trips (bpe.py). `train_steps` trains the model on text before it is saved (training.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.cli import add_settings_arguments, settings_from_args
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
from moe_mesh.dev.training import read_text, settings_for, split_corpus, train, write_outputs

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "dbrx", "glm4_moe")
PRESETS = ("tiny", "small")
EXPERT_LAYOUTS = ("per_expert", "fused")
QUANTIZATIONS = ("mxfp4",)  # gpt-oss's published expert format
DTYPES = ("float32", "bfloat16")


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
    dtype: str = "float32",
    train_steps: int = 0,
    train_text: Path | None = None,
) -> Path:
    """Write a random-initialised HuggingFace-layout checkpoint (config.json, safetensors, tokenizer); return out_dir.

    ``arch`` is one of ARCHS and ``preset`` one of PRESETS. The same arguments give byte-identical files.
    ``overrides`` are merged into the transformers config kwargs last (aliases such as Mixtral's ``num_experts``
    are resolved to the family's canonical field first; a dict merges into the preset's sub-config of that name,
    e.g. DBRX's ``ffn_config={"moe_top_k": 4}``).

    ``router_skew`` biases every router towards a few per-layer "hot" experts (a different, seeded set per
    layer), in units of the gate logits' per-token spread: 0 is uniform, 2-4 gives realistic hot experts
    (docs/design/checkpoints.md has the bias and the shares it gives).
    ``expert_layout="fused"`` stores experts as transformers v5 3-D tensors
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) instead of one tensor per
    expert (not for dbrx, whose own layout is fused). ``max_shard_size`` is passed to ``save_pretrained``
    (e.g. "200MB"); ``progress`` prints stage messages and progress bars on stderr.
    gpt-oss stores its experts fused (``[E, H, 2I]`` with gate and up columns alternating, ``[E, I, H]``)
    whatever the layout; ``quantize="mxfp4"`` writes them as published gpt-oss checkpoints do.
    ``dtype="bfloat16"`` stores the weights in bfloat16: drawn in float32, cast before saving
    (saving holds copies of the weights: a 2.5 G-parameter float32 model peaked at 16.5 GB RSS).
    ``train_steps > 0`` trains the float32 model on ``train_text`` (default: the project's docs) before the
    cast, quantization and layout rewrite, and writes the text's held-out tail to ``heldout.txt`` and the
    losses to ``training.json`` (training.py); router skew is applied before training, which then has no
    router losses (they would train it away).

    Raises ValueError for unknown arch/preset/layout or an out_dir that cannot be created, and
    FileExistsError if out_dir exists and is not empty.
    """
    out_dir = Path(out_dir)
    _check_arguments(out_dir, arch, preset, expert_layout, quantize, dtype, train_steps, train_text)
    # Here, not at module level: `moe-mesh probe` and friends must start fast.
    import torch
    from tokenizers import Tokenizer

    def stage(msg: str) -> None:
        if progress:
            print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)

    p = {**PRESET_SIZES[preset], **FAMILY_PRESETS.get((arch, preset), {})}
    stage(f"training byte-level BPE tokenizer (target vocab {p['vocab']})")
    tokenizer = Tokenizer.from_str(tokenizer_json(p["vocab"]))
    settings = settings_for(train_steps, router_skew)
    corpus = split_corpus(*read_text(train_text), tokenizer, settings) if train_steps else None
    config = _config(arch, p, tokenizer.get_vocab_size(), overrides, quantize)
    stage(f"initialising {CLASSES[arch][1]} ({preset}, seed {seed})")
    model = _random_model(arch, config, seed, router_skew)
    log = None if corpus is None else train(model, corpus, settings, seed, stage)
    model.to(getattr(torch, dtype))  # parameter by parameter: one float32 copy at most
    n_params = sum(t.numel() for t in model.parameters())
    size = n_params * next(model.parameters()).element_size()
    stage(f"writing {n_params / 1e6:.1f}M parameters ({size / 2**20:.0f} MiB {dtype}) to {out_dir}")
    _save_model(model, out_dir, max_shard_size, progress)
    if corpus is not None and log is not None:
        write_outputs(out_dir, corpus, log)
    if arch == "qwen3_moe":
        _rename_qwen3_expert_count(out_dir / "config.json")
    if expert_layout == "fused":
        stage("rewriting experts as fused 3-D tensors")
        fuse_experts(out_dir, progress)
    if quantize == "mxfp4":
        stage("quantizing experts to MXFP4")
        quantize_mxfp4(out_dir)
    stage("saving tokenizer")
    _save_tokenizer(tokenizer, out_dir, config.max_position_embeddings)
    stage("done")
    return out_dir


def _check_arguments(
    out_dir: Path,
    arch: str,
    preset: str,
    expert_layout: str,
    quantize: str | None,
    dtype: str,
    train_steps: int,
    train_text: Path | None,
) -> None:
    """Every argument problem, before seconds go into building a model (the training text is read,
    and checked, before the model is built too)."""
    if train_steps < 0 or (train_text is not None and not train_steps):
        raise ValueError(f"train_steps must be > 0 to train on train_text, not {train_steps}")
    for what, value, valid in (
        ("arch", arch, ARCHS),
        ("preset", preset, PRESETS),
        ("expert_layout", expert_layout, EXPERT_LAYOUTS),
        ("dtype", dtype, DTYPES),
    ):
        if value not in valid:
            raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(valid)}")
    if arch == "dbrx" and expert_layout == "fused":
        raise ValueError("expert_layout 'fused' is not for dbrx: its experts are fused already")
    if quantize is not None and (quantize not in QUANTIZATIONS or arch != "gpt_oss"):
        raise ValueError(f"quantize={quantize!r}: only gpt_oss has one, {', '.join(QUANTIZATIONS)}")
    if arch == "gpt_oss" and expert_layout != "per_expert":
        raise ValueError("gpt_oss experts are fused already: expert_layout applies to the others")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"output directory {out_dir} already exists and is not empty")
    # Now, not after the model is built: the nearest existing ancestor must take a directory.
    ancestor = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())
    if not (ancestor.is_dir() and os.access(ancestor, os.W_OK)):
        raise ValueError(
            f"cannot create output directory {out_dir}: {ancestor} is not a writable directory"
        )


def _config(
    arch: str,
    preset: dict[str, Any],
    vocab_size: int,
    overrides: Mapping[str, Any] | None,
    quantize: str | None,
) -> Any:
    """The transformers config of the family's preset with `overrides` merged in."""
    import transformers  # here, not at module level: `moe-mesh probe` and friends must start fast

    config_cls = getattr(transformers, CLASSES[arch][0])
    alias = getattr(config_cls, "attribute_map", {})  # an override of an alias replaces the field
    merged = config_kwargs(arch, preset, vocab_size)
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
    return config


def _random_model(arch: str, config: Any, seed: int, router_skew: float) -> Any:
    """The family's model with seeded float32 weights (and router skew), in eval mode."""
    import torch  # here, not at module level: `moe-mesh probe` and friends must start fast
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[arch][1])(config).to(torch.float32).eval()
    init_parameters(model, seed)
    if router_skew:
        apply_router_skew(model, router_skew, seed)
    return model


def _save_model(
    model: Any, out_dir: Path, max_shard_size: str | int | None, progress: bool
) -> None:
    """save_pretrained, with transformers' progress bars only when `progress`."""
    from transformers.utils import logging as hf_logging  # here: see _random_model

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


def _rename_qwen3_expert_count(cfg_path: Path) -> None:
    """transformers 5.23 serialises Qwen3-MoE's expert count under its alias num_local_experts;
    published Qwen3-MoE checkpoints (and parsers written against them) use num_experts, which
    transformers also reads."""
    cfg = json.loads(cfg_path.read_text())
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
        cfg_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def _save_tokenizer(tokenizer: Any, out_dir: Path, max_positions: int) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    # Written by hand rather than by transformers 5.x, whose "TokenizersBackend" class name 4.x cannot load.
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


class CreateSettings(BaseModel):
    """`moe-mesh checkpoint create`'s flags: create_checkpoint's arguments."""

    model_config = ConfigDict(extra="forbid")

    arch: Literal[ARCHS] = Field(description="model family")  # type: ignore[valid-type]
    preset: Literal[PRESETS] = Field(  # type: ignore[valid-type]
        "tiny", description="tiny: unit tests; small: benchmarks (~1 GB)"
    )
    out: Path = Field(description="output directory (must not exist or be empty)")
    seed: int = Field(0, description="seed of the random weights")
    router_skew: float = Field(
        0.0,
        description="hot-expert bias in gate-logit std units: 0 uniform, 2-4 realistic hot experts",
    )
    expert_layout: Literal[EXPERT_LAYOUTS] = Field(  # type: ignore[valid-type]
        "per_expert", description="one tensor per expert, or transformers v5's fused 3-D tensors"
    )
    max_shard_size: int | str | None = Field(None, description='e.g. "200MB" or a byte count')
    quantize: Literal[QUANTIZATIONS] | None = Field(  # type: ignore[valid-type]
        None, description="gpt_oss: store the experts in MXFP4, as published gpt-oss checkpoints do"
    )
    dtype: Literal[DTYPES] = Field(  # type: ignore[valid-type]
        "float32",
        description="dtype of the stored weights (drawn and trained in float32, then cast)",
    )
    train_steps: int = Field(
        0, ge=0, description="train the model this many steps before saving (0: random weights)"
    )
    train_text: Path | None = Field(
        None, description="UTF-8 text to train on (default: the project's docs/**/*.md)"
    )
    override: list[tuple[str, Any]] | None = Field(
        None,
        description="config field override, repeatable (e.g. num_experts_per_tok=1)",
        json_schema_extra={"metavar": "KEY=JSON"},
    )

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _byte_count(cls, value: Any) -> Any:
        return int(value) if isinstance(value, str) and value.isdigit() else value

    @field_validator("override", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [_parse_override(v) if isinstance(v, str) else v for v in value]


def _cmd_create(args: argparse.Namespace) -> int:
    s = typing.cast(CreateSettings, settings_from_args(CreateSettings, args))
    try:
        out = create_checkpoint(
            s.out,
            s.arch,
            s.preset,
            seed=s.seed,
            router_skew=s.router_skew,
            overrides=dict(s.override or []),
            expert_layout=s.expert_layout,
            max_shard_size=s.max_shard_size,
            progress=s.preset != "tiny" or s.train_steps > 0,
            quantize=s.quantize,
            dtype=s.dtype,
            train_steps=s.train_steps,
            train_text=s.train_text,
        )
    except (FileExistsError, ValueError) as exc:
        print(f"moe-mesh checkpoint create: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the disk, not the command: full, or a path the checks above let by
        print(f"moe-mesh checkpoint create: error: writing {s.out}: {exc}", file=sys.stderr)
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
    add_settings_arguments(create, CreateSettings)
    create.set_defaults(func=_cmd_create)
