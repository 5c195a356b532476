"""Random-initialised MoE checkpoints in HuggingFace layout, for tests and CPU benchmarks.

Models are built with transformers' own classes so the files are exactly what transformers writes (plus an
optional rewrite to the fused v5 expert layout), and the tokenizer is a byte-level BPE trained on a small
built-in corpus so that any UTF-8 text round-trips.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "dbrx", "glm4_moe")
PRESETS = ("tiny", "small")
EXPERT_LAYOUTS = ("per_expert", "fused")
QUANTIZATIONS = ("mxfp4",)  # gpt-oss's published expert format

EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"  # ids 0 and 1; EOS doubles as BOS

# init: initializer_range, chosen per width so that greedy decoding of the random model does not collapse into
# a repeated token (at width 1024 the default 0.02 loops within ~10 tokens, 0.05 stays varied; 0.02 suits 64).
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden=64,
        layers=3,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=8,
        top_k=2,
        expert_width=96,
        dense_width=128,
        shared_width=128,
        max_pos=512,
        vocab=512,
        init=0.02,
    ),
    "small": dict(
        hidden=1024,
        layers=8,
        heads=16,
        kv_heads=4,
        head_dim=64,
        experts=8,
        top_k=2,
        expert_width=1024,
        dense_width=2048,
        shared_width=2048,
        max_pos=4096,
        vocab=8192,
        init=0.05,
    ),
}
# (arch, preset) -> preset fields a family changes. DBRX's small has its published 16 experts top-4,
# half as wide: the others' small's expert parameters and active parameters per token.
_FAMILY_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("dbrx", "small"): dict(experts=16, top_k=4, expert_width=512),
}
_CLASSES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "dbrx": ("DbrxConfig", "DbrxForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
}

# Router skew: every embedding row gets the same value on _DC_DIM (_DC_AMPLITUDE init-stds), giving all gate
# inputs a shared direction that per-expert gate weights on that dimension turn into a constant logit bias.
_DC_DIM, _DC_AMPLITUDE = 0, 4.0

_PROSE = """\
The harbour was quiet in the early morning, and the fishing boats rocked gently against the old stone pier. A gull circled twice above the lighthouse before settling on a post, watching the nets being hauled in. Somewhere up the hill a radio played a song about rivers, distant mountains and the people who leave home.
Mixture-of-experts models send every token to a small number of specialised feed-forward networks. A learned router scores each expert, keeps the best few, and mixes their outputs with the normalised scores. Because only a fraction of the weights is used for any one token, such a model can be very large and still be cheap to run.
In a serving system the experts may live on different machines. The router decides where each hidden state should go, gathers the answers, and continues with the next layer. Latency depends on how evenly the traffic is spread: when a handful of experts are popular, their servers become the bottleneck while the others sit idle.
She opened the window and let the cold air into the kitchen. The kettle was already singing, the bread was still warm, and on the table lay a letter she had not yet found the courage to read. Outside, the children were arguing about whose turn it was to feed the chickens.
Numbers such as 3.14159, 2048, 1e-5 and 65,536 appear in configuration files, logs and error messages. A request might carry an identifier like req-7f3a9c, a timeout of 30 seconds, and a budget of 512 new tokens. Good tools print clear messages when something goes wrong and tell you exactly which value was rejected.
Autumn came early that year. The maple leaves turned red before the end of September, the river rose after a week of rain, and the market filled with apples, pumpkins and jars of dark honey. Travellers stopped at the inn by the bridge to dry their coats and tell stories of the road.
"""


def _pseudo_sentences(n: int, seed: int = 1234) -> Iterator[str]:
    # Prose alone runs out of merges long before 8k tokens; a seeded Zipf-ish stream of invented words fills in.
    rng = random.Random(seed)
    syllables = [
        o + v + c
        for o in (
            "",
            "b",
            "br",
            "c",
            "ch",
            "d",
            "dr",
            "f",
            "g",
            "gr",
            "h",
            "j",
            "k",
            "l",
            "m",
            "n",
            "p",
            "pl",
            "qu",
            "r",
            "s",
            "sh",
            "st",
            "t",
            "th",
            "tr",
            "v",
            "w",
            "z",
        )
        for v in ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "oo")
        for c in ("", "", "n", "r", "s", "t", "l", "m", "nd", "ck", "st", "x")
    ]
    lexicon = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(8000)
    ]
    for _ in range(n):
        words = (
            lexicon[min(int(rng.paretovariate(0.8)) - 1, len(lexicon) - 1)]
            if rng.random() < 0.5
            else rng.choice(lexicon)
            for _ in range(12)
        )
        yield " ".join(words).capitalize() + "."


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE (deterministic for a given vocab size) and return it serialised."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # every byte: no <unk>
    corpus = _PROSE.splitlines() * 4  # repeated so English merges outrank the invented words
    tok.train_from_iterator([*corpus, *_pseudo_sentences(max(0, vocab_size - 512) * 3)], trainer)
    return tok.to_str(pretty=True)


def _config_kwargs(arch: str, p: Mapping[str, Any], vocab: int) -> dict[str, Any]:
    if arch == "dbrx":
        return _dbrx_kwargs(p, vocab)
    kw: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=p["hidden"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        num_experts_per_tok=p["top_k"],
        max_position_embeddings=p["max_pos"],
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        initializer_range=p["init"],
    )
    if arch == "mixtral":
        kw.update(
            head_dim=p["head_dim"],
            num_local_experts=p["experts"],
            intermediate_size=p["expert_width"],
        )
    elif arch == "olmoe":
        kw.update(num_experts=p["experts"], intermediate_size=p["expert_width"])
    elif arch == "deepseek_v3":  # latent attention: heads expand their keys/values from one latent
        kw.update(
            num_key_value_heads=p["heads"],
            kv_lora_rank=p["hidden"] // 2,
            q_lora_rank=3 * p["hidden"] // 4,
            qk_nope_head_dim=p["head_dim"],
            qk_rope_head_dim=p["head_dim"] // 2,
            v_head_dim=p["head_dim"],
            n_routed_experts=p["experts"],
            n_group=4,
            topk_group=2,
            moe_intermediate_size=p["expert_width"],
            n_shared_experts=1,
            first_k_dense_replace=0,
            intermediate_size=p["dense_width"],
            num_mtp_layers=0,  # no multi-token-prediction layer is written
        )
    elif arch == "gpt_oss":
        # YaRN as published gpt-oss has it (there factor 32 over 4096 original positions), with
        # a factor that matches the preset's max_position_embeddings (else transformers warns).
        # The window: 128 in the small preset (as published), 16 in the tiny one, which most
        # test sequences outgrow.
        kw.update(
            head_dim=p["head_dim"],
            num_local_experts=p["experts"],
            intermediate_size=p["expert_width"],
            sliding_window=p["max_pos"] // 32,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=8.0,
                original_max_position_embeddings=p["max_pos"] // 8,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        )
    elif arch == "glm4_moe":  # as GLM-4.5: q/k norm, q/k/v bias, half rotary, first layer dense
        kw.update(
            head_dim=p["head_dim"],
            n_routed_experts=p["experts"],
            moe_intermediate_size=p["expert_width"],
            intermediate_size=p["dense_width"],
            n_shared_experts=1,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
            routed_scaling_factor=2.5,
        )
    else:  # Qwen: experts use moe_intermediate_size, dense (mlp_only) layers intermediate_size
        kw.update(
            num_experts=p["experts"],
            moe_intermediate_size=p["expert_width"],
            intermediate_size=p["dense_width"],
        )
        if arch == "qwen2_moe":
            kw.update(shared_expert_intermediate_size=p["shared_width"])
        else:  # not a declared Qwen3MoeConfig field, but the attention reads it and published configs set it
            kw.update(head_dim=p["head_dim"])
    return kw


def _dbrx_kwargs(p: Mapping[str, Any], vocab: int) -> dict[str, Any]:
    """DBRX spells the Llama fields its own way and nests attention and FFN settings."""
    theta = 500000.0  # published DBRX's; transformers 5.23 reads rope_parameters, yet needs attn_config's
    return dict(
        vocab_size=vocab,
        d_model=p["hidden"],
        n_layers=p["layers"],
        n_heads=p["heads"],
        max_seq_len=p["max_pos"],
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        attn_config=dict(kv_n_heads=p["kv_heads"], clip_qkv=8.0, rope_theta=theta),
        ffn_config=dict(
            ffn_hidden_size=p["expert_width"],
            moe_num_experts=p["experts"],
            moe_top_k=p["top_k"],
        ),
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        initializer_range=p["init"],
    )


def _skew_targets(model: torch.nn.Module) -> tuple[Any, torch.nn.Module, list[Any]]:
    """(embedding, decoder layers, router linears) in the family's module layout."""
    if model.config.model_type == "dbrx":
        blocks = model.transformer.blocks
        return model.transformer.wte, blocks, [b.ffn.router.layer for b in blocks]
    layers = model.model.layers  # dense layers have no gate
    return model.model.embed_tokens, layers, [g for x in layers if (g := _gate(x)) is not None]


def _gpt_oss_init(model: torch.nn.Module, seed: int) -> None:
    """Trained gpt-oss has sinks of order one and non-zero biases; transformers initialises biases to
    zero and sinks at initializer_range, which would leave what they do untested. The biases stay
    small (a tenth of initializer_range): adding the same vector to every token, larger ones
    would give every token's router input a common direction, i.e. unrequested router skew."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)  # a stream of its own, like the router skew's
    std = model.config.initializer_range / 10
    with torch.no_grad():
        for name, w in model.model.layers.named_parameters():
            if name.endswith("sinks"):
                w.copy_(torch.randn(w.shape, generator=gen))
            elif name.endswith("bias") and "router" not in name:  # the router's is random already
                w.copy_(std * torch.randn(w.shape, generator=gen))


def _gate(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's router (gpt-oss calls it `router`); None on a dense layer."""
    return getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)


def _randomise_correction_bias(model: torch.nn.Module, seed: int) -> None:
    """Give routers with an e_score_correction_bias (DeepSeek-V3, GLM-4.5) a random one, as published
    checkpoints have: transformers initialises it to zeros, which would leave untested that it
    steers which experts are chosen but not their weights. A quarter of initializer_range changes
    the choice of 15-20% of the tiny preset's tokens and leaves the load as even (uniform-routing
    top-2 share ~0.3); a larger one would make experts hot, which the bias exists to prevent."""
    import torch

    # Its own stream: it neither moves nor depends on the init order.
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range / 4
    with torch.no_grad():
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.copy_(torch.randn(bias.shape, generator=gen) * std)


def _apply_router_skew(model: torch.nn.Module, skew: float, seed: int) -> None:
    """Give each MoE layer a Zipf-shaped per-expert gate bias of ``skew`` gate-logit standard deviations."""
    import torch

    sigma = model.config.initializer_range
    gen = torch.Generator().manual_seed(
        seed
    )  # separate stream: must not disturb or depend on init order
    embed, layers, gates = _skew_targets(model)
    with torch.no_grad():
        embed.weight[:, _DC_DIM] = _DC_AMPLITUDE * sigma
        # Reserve the DC dimension for the routers: attention and MLPs neither read it (a constant input would
        # leak a consistent random direction into the residual stream, i.e. unrequested skew) nor write to it.
        # gpt-oss stores experts as [experts, in, out], has biases, and the ones of its
        # down and o projections add to the residual stream too. (DBRX's w2 [experts * inter,
        # hidden] writes through its last dim, as the readers read.)
        transposed = model.config.model_type == "gpt_oss"
        for name, w in layers.named_parameters():
            writes = "down_proj" in name or "o_proj" in name or "out_proj" in name
            if transposed and name.endswith("bias"):
                if writes:
                    w[..., _DC_DIM] = 0.0
                continue
            if w.ndim < 2:
                continue
            if transposed and ".experts." in name:
                w.index_fill_(w.ndim - (1 if writes else 2), torch.tensor([_DC_DIM]), 0.0)
            elif writes:
                w.index_fill_(w.ndim - 2, torch.tensor([_DC_DIM]), 0.0)
            else:
                w[..., _DC_DIM] = 0.0
        if model.lm_head.weight.data_ptr() != embed.weight.data_ptr():
            model.lm_head.weight[:, _DC_DIM] = (
                0.0  # else every prompt would favour the same output tokens
            )

        # Calibrate on random tokens: attention output soon dominates the residual stream in wide models, so the
        # normalised DC value and the logits' spread both depend on width and depth and are measured, not derived.
        stats: list[tuple[float, float]] = []

        def measure(_module: torch.nn.Module, args: tuple, out: tuple) -> None:
            x, logits = args[0], out if isinstance(out, torch.Tensor) else out[0]
            stats.append((x[..., _DC_DIM].mean().item(), (logits - logits.mean(0)).std().item()))

        hooks = [g.register_forward_hook(measure) for g in gates]
        try:
            model(
                input_ids=torch.randint(2, model.config.vocab_size, (4, 64), generator=gen),
                use_cache=False,
            )
        finally:
            for hook in hooks:
                hook.remove()
        for gate, (dc, spread) in zip(gates, stats, strict=True):
            n = gate.weight.shape[0]
            z = 1.0 / torch.arange(1, n + 1, dtype=torch.float32)
            hot_order = torch.randperm(
                n, generator=gen
            )  # hot_order[r] is the expert with popularity rank r
            # 3 significant digits: the measurement's last bits can depend on thread count, the files must not.
            scale = float(f"{skew * spread / dc:.3g}")
            gate.weight[hot_order, _DC_DIM] = (scale * (z - z.mean())).to(gate.weight.dtype)


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


def _fuse_experts(out_dir: Path, progress: bool) -> None:
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


def _quantize_mxfp4(out_dir: Path) -> None:
    """Rewrite gpt-oss's float experts as published: ``*_blocks`` / ``*_scales`` in MXFP4 with rows
    of [E, 2I, H] and [E, H, I] (transformers keeps [E, H, 2I] and [E, I, H]), biases as they are,
    and a ``quantization_config`` in config.json."""
    from safetensors.torch import load_file, save_file

    from moe_mesh.common import mxfp4

    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    for fname in files:
        tensors = load_file(out_dir / fname)
        for name in [
            n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        ]:
            blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            if index:
                shard = index["weight_map"].pop(name)
                index["weight_map"].update({name + "_blocks": shard, name + "_scales": shard})
        save_file(tensors, out_dir / (fname + ".tmp"), metadata={"format": "pt"})
        os.replace(out_dir / (fname + ".tmp"), out_dir / fname)
    if index:
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {  # what openai/gpt-oss-20b's config.json says
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


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

    Raises ValueError for unknown arch/preset/layout and FileExistsError if out_dir exists and is not empty.
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

    import torch  # here, not at module level: `moe-mesh probe` and friends must start fast
    import transformers
    from tokenizers import Tokenizer
    from transformers.utils import logging as hf_logging

    def stage(msg: str) -> None:
        if progress:
            print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)

    p = {**_PRESETS[preset], **_FAMILY_PRESETS.get((arch, preset), {})}
    stage(f"training byte-level BPE tokenizer (target vocab {p['vocab']})")
    tokenizer = Tokenizer.from_str(_tokenizer_json(p["vocab"]))
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[arch])
    alias = getattr(
        config_cls, "attribute_map", {}
    )  # lets an override of an alias replace the preset's field
    merged = _config_kwargs(arch, p, tokenizer.get_vocab_size())
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
    if arch == "gpt_oss":
        _gpt_oss_init(model, seed)
    _randomise_correction_bias(model, seed)
    if router_skew:
        _apply_router_skew(model, router_skew, seed)
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
        _fuse_experts(out_dir, progress)
    if quantize == "mxfp4":
        stage("quantizing experts to MXFP4")
        _quantize_mxfp4(out_dir)

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
