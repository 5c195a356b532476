"""What the parts of bench/gpu_check.py share: the context a part runs in (its device, scratch folder,
deadline, and a result written as it grows, so that a part stopped at its time bound still leaves
what it measured), greedy runs of the engine and of transformers on one device, and completions
through a running mesh's gateway."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The reference prompts of tests/e2e/test_parity.py (ids below every preset's vocabulary).
PROMPTS = [[7], [11, 3, 250, 9, 31], list(range(40, 53)), [(i * 37) % 400 + 5 for i in range(29)]]
NEW_TOKENS = 32


@dataclass
class Context:
    """One part's run: where it computes, its scratch folder (shared by the parts of one check, so
    a later part reuses an earlier one's checkpoints), when it must be done, and its result."""

    device: str  # "cuda", "cuda:N" or "cpu" (a rehearsal on a host without a GPU)
    work: Path
    deadline: float  # time.monotonic() by which the part must have returned
    result_path: Path | None = None  # the result as it grows, for the check to read
    slice_layers: int | None = None  # part c's slices' layers (None: bench/geometry.py's)
    result: dict[str, Any] = field(default_factory=dict)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, key: str, value: Any) -> None:
        """result[key] = value, written at once (atomically) where the check reads it."""
        self.result[key] = value
        if self.result_path is not None:
            partial = self.result_path.with_suffix(".partial")
            partial.write_text(json.dumps(self.result, indent=2, default=str))
            os.replace(partial, self.result_path)

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def tiny_checkpoint(ctx: Context, family: str) -> Path:
    """The family's tiny preset (seed 0) under the scratch folder, created on first use."""
    from moe_mesh.dev.create_checkpoint import create_checkpoint

    path = ctx.work / f"tiny-{family}"
    if not (path / "config.json").exists():
        partial = path.with_name(path.name + ".partial")
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
        create_checkpoint(partial, family, "tiny", seed=0)
        partial.rename(path)
    return path


def engine_greedy(
    engine, prompts: list[list[int]], n: int, logits: bool = False
) -> tuple[list[list[int]], list[Any]]:
    """The engine's greedy continuations of `prompts` served together (EOS ignored) and, with
    `logits`, the float32 logits each token was chosen from [steps, vocab] per prompt (read where
    the engine hands them to `sample`, as tests/e2e/test_parity_dtypes.py reads them)."""
    from dataclasses import replace

    from common.sampling import SamplingParams
    from router_service.engine import engine as engine_module

    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rows: dict[int, list[Any]] = {i: [] for i in range(len(prompts))}
    real = engine_module.sample

    def spy(row, params: SamplingParams, generator) -> int:
        rows[params.seed].append(row.float().cpu())  # greedy ignores the seed: it names the request
        return real(row, params, generator)

    if logits:
        engine_module.sample = spy
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, replace(greedy, seed=i))
        out: dict[str, list[int]] = {}

        async def drive() -> None:
            while engine.has_unfinished():
                for o in await engine.step():
                    if o.error is not None:
                        raise RuntimeError(f"request {o.request_id}: {o.error}")
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)

        asyncio.run(drive())
    finally:
        engine_module.sample = real
    return [out[str(i)] for i in range(len(prompts))], [rows[i] for i in range(len(prompts))]


def load_hf(path: Path, dtype_name: str, device: str):
    """transformers' model of `path` in `dtype_name` on `device`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name))
    return model.to(device).eval()


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers `generate`: each prompt's n greedy tokens (EOS ignored), one prompt at a time
    (the reference prompts differ in length, and padding would change what is computed)."""
    import torch

    out = []
    device = next(model.parameters()).device
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            got = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(got[0, len(prompt) :].tolist())
    return out


def first_divergence(ours: list[list[int]], theirs: list[list[int]]) -> dict | None:
    """Where the two sets of continuations first differ (prompt, step, both tokens), or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for step, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return {"prompt": i, "step": step, "ours": x, "transformers": y}
        if len(a) != len(b):
            return {"prompt": i, "step": min(len(a), len(b)), "lengths": [len(a), len(b)]}
    return None


def complete(client, prompt: list[int], max_tokens: int) -> list[int]:
    """A greedy completion of token ids through a gateway's OpenAI API (an httpx client whose
    base URL ends in /v1), its token ids."""
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    reply = client.post("/completions", json={**body, "ignore_eos": True, "return_token_ids": True})
    reply.raise_for_status()
    return reply.json()["choices"][0]["token_ids"]


def free_device_memory() -> None:
    """Collect what nothing references and return the CUDA cache, between models."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
