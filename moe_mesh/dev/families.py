"""What `checkpoint create` knows per family: preset sizes, the transformers config each family
is built from, parameters transformers would leave at zero, and the router skew.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# init: initializer_range, chosen per width so that greedy decoding of the random model does not collapse into
# a repeated token (at width 1024 the default 0.02 loops within ~10 tokens, 0.05 stays varied; 0.02 suits 64).
PRESET_SIZES: dict[str, dict[str, Any]] = {
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
FAMILY_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("dbrx", "small"): dict(experts=16, top_k=4, expert_width=512),
}
CLASSES = {
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


def config_kwargs(arch: str, p: Mapping[str, Any], vocab: int) -> dict[str, Any]:
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
    elif arch == "deepseek_v3":
        kw.update(_deepseek_v3_kwargs(p))
    elif arch == "gpt_oss":
        kw.update(_gpt_oss_kwargs(p))
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


def _deepseek_v3_kwargs(p: Mapping[str, Any]) -> dict[str, Any]:
    """Latent attention: heads expand their keys/values from one latent."""
    return dict(
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


def _gpt_oss_kwargs(p: Mapping[str, Any]) -> dict[str, Any]:
    # YaRN as published gpt-oss has it (there factor 32 over 4096 original positions), with
    # a factor that matches the preset's max_position_embeddings (else transformers warns).
    # The window: 128 in the small preset (as published), 16 in the tiny one, which most
    # test sequences outgrow.
    return dict(
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


def init_parameters(model: torch.nn.Module, seed: int) -> None:
    """Give parameters that transformers initialises to (near) zero the values a trained model has,
    so that tests see what they do: gpt-oss sinks and biases, sigmoid routers' correction bias."""
    if model.config.model_type == "gpt_oss":
        _gpt_oss_init(model, seed)
    _randomise_correction_bias(model, seed)


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


def apply_router_skew(model: torch.nn.Module, skew: float, seed: int) -> None:
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
