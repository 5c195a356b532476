"""Loading our checkpoints in transformers, for tests that check what `moe-mesh checkpoint create` writes."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.support.reference import PROMPTS


def load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    # A silently re-initialised tensor would make every parity check built on it meaningless.
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def moe_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module, torch.nn.Module]]:
    """(layer, MoE block, router) of each MoE layer. A router's weight is [experts, hidden]; its
    output is the logits, or a tuple starting with them (`router_logits`)."""
    if model.config.model_type == "dbrx":
        return [(i, b.ffn, b.ffn.router.layer) for i, b in enumerate(model.transformer.blocks)]
    # gpt-oss names its router `router`; Qwen's dense layers have none.
    routers = [
        getattr(x.mlp, "gate", None) or getattr(x.mlp, "router", None) for x in model.model.layers
    ]
    return [
        (i, x.mlp, r) for i, (x, r) in enumerate(zip(model.model.layers, routers)) if r is not None
    ]


def router_logits(out: torch.Tensor | tuple) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def top2_share_per_layer(path: Path) -> list[float]:
    """Fraction of routed slots taken by each MoE layer's two most-used experts, on random token ids."""
    model = load(path)
    counts: list[torch.Tensor] = []

    def chosen(out: torch.Tensor | tuple) -> torch.Tensor:  # DBRX's router returns only logits
        return out[2] if isinstance(out, tuple) else out.topk(model.config.ffn_config.moe_top_k)[1]

    hooks = [
        router.register_forward_hook(
            lambda _m, _i, out: counts.append(torch.bincount(chosen(out).flatten()))
        )
        for _, _, router in moe_blocks(model)
    ]
    # Many short sequences: tokens of one sequence share attention context and so route alike.
    ids = torch.randint(
        2, model.config.vocab_size, (128, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return [(c.sort(descending=True).values[:2].sum() / c.sum()).item() for c in counts]


def greedy_tokens(model: torch.nn.Module, prompt: Sequence[int], n: int) -> list[int]:
    """transformers `generate`: the n greedy tokens after `prompt`, EOS ignored."""
    ids = model.generate(
        torch.tensor([list(prompt)]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return ids[0, len(prompt) :].tolist()


@cache
def greedy(path: Path, max_tokens: int = 32) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy continuations of the reference prompts (EOS ignored): what every mesh,
    whatever carries its activations, must answer token for token."""
    model = load(path)
    return tuple(tuple(greedy_tokens(model, prompt, max_tokens)) for prompt in PROMPTS)
