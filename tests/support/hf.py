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


def gate(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's router module (gpt-oss names it `router`); None on a dense layer."""
    return getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)


def top2_share_per_layer(path: Path) -> list[float]:
    """Fraction of routed slots taken by each MoE layer's two most-used experts, on random token ids."""
    model = load(path)
    counts: list[torch.Tensor] = []
    hooks = [
        gate(layer).register_forward_hook(
            lambda _m, _i, out: counts.append(torch.bincount(out[2].flatten()))
        )
        for layer in model.model.layers
        if gate(layer) is not None
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
