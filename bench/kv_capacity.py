"""Sequences of ~1,000 tokens in a fixed KV-cache byte budget: how many run at once, and their
decode tokens/s, slot cache vs paged (local engine, every expert colocated, `small` preset Mixtral
by default, float32 unless `--dtype`).

The slot cache this replaced gave every running sequence a slot of the longest sequence's length,
both dimensions grown by doubling (from 4 slots of 128 tokens): 1,000-token sequences take slots
of 1,024 tokens, and the slot count is a power of two, so in a budget it holds the largest power
of two of such slots that fits. The paged cache holds budget / (16 tokens x bytes per token)
blocks, 63 per sequence. The slot figure is computed that way (it had no admission control: past
it, it would have allocated beyond the budget). Its decode rate is measured with
`--slot-checkout DIR`, a checkout of the slot-cache engine (e.g. the commit before the paged
cache) run at that many sequences, next to this engine capped at as many (what gathering blocks
costs against the slot cache's views); without it, with this engine capped at that many.
Each measurement runs in a fresh process: `--requests` prompts of `--prompt-len` random tokens,
as many admitted as fit, prefilled in one step, then their decode steps timed until the first
sequence ends (`--new-tokens` in all).

    .venv/bin/python -m bench.kv_capacity [--checkpoint DIR] [--budget 400MiB] [--slot-checkout DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common import runtime

runtime.configure()  # before torch loads OpenMP
from typing import Literal  # noqa: E402

import torch  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, ensure_checkpoint, parse_settings, write_result  # noqa: E402
from common.checkpoint import Checkpoint  # noqa: E402
from common.units import parse_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh process with either checkout on its path: only API both engines share.
MEASURE = r"""
import asyncio, json, sys, time
from common import runtime
runtime.configure()
import torch
from router_service.build import build_local_engine
from common.sampling import SamplingParams
from router_service.settings import RouterSettings

args = json.loads(sys.argv[1])
engine = build_local_engine(RouterSettings(**args["settings"]))
vocab = engine.model.spec.vocab_size
gen = torch.Generator().manual_seed(0)
params = SamplingParams(args["new_tokens"], 0.0, ignore_eos=True)
for i in range(args["requests"]):
    engine.add_request(str(i), torch.randint(3, vocab, (args["prompt_len"],), generator=gen).tolist(), params)

async def drive():
    # All admitted at once, one prefill step, then decode steps until the first sequence ends.
    await engine.step()
    times, most = [], len(engine.running)
    while True:
        start = time.perf_counter()
        outputs = await engine.step()
        times.append((time.perf_counter() - start, sum(len(o.new_token_ids) for o in outputs)))
        if any(o.finish_reason is not None for o in outputs):
            return times, most

times, most = asyncio.run(drive())
seconds, tokens = sum(t for t, _ in times), sum(n for _, n in times)
print(json.dumps({"concurrent": most, "decode_steps": len(times), "decode_tokens_per_s": tokens / seconds,
                  "cache_bytes": engine.cache.nbytes}))
"""


def measure(checkout: Path, settings: dict, requests: int, args) -> dict:
    payload = dict(
        settings=settings, requests=requests, prompt_len=args.prompt_len, new_tokens=args.new_tokens
    )
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(payload)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=checkout,
    )
    return json.loads(out.stdout.splitlines()[-1])


def slot_capacity(budget: int, token_bytes: int, length: int) -> int:
    """Sequences the slot cache held in `budget`: the largest power-of-two slot count (from 4)
    of slots doubled from 128 tokens to `length`."""
    capacity = 128
    while capacity < length:
        capacity *= 2
    slots = 4
    while 2 * slots * capacity * token_bytes <= budget:
        slots *= 2
    return slots if slots * capacity * token_bytes <= budget else 0


class Settings(ScriptSettings):
    out: Path = Field(Path("bench/results/kv_capacity.json"), description="the JSON result")
    budget: str = Field("400MiB", description="KV-cache bytes")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="compute dtype")
    prompt_len: int = Field(968, ge=1, description="prompt tokens per request")
    new_tokens: int = Field(32, ge=1, description="tokens generated per request")
    requests: int = Field(48, ge=1, description="more than either cache holds")
    slot_checkout: Path | None = Field(None, description="a checkout of the slot-cache engine")


def main() -> int:
    args = parse_settings(Settings, __doc__)

    ensure_checkpoint(args.checkpoint)
    checkpoint = args.checkpoint.resolve()
    spec = Checkpoint(checkpoint).spec
    itemsize = getattr(torch, args.dtype).itemsize
    heads, k_dim, v_dim = spec.kv_dims
    token_bytes = spec.num_layers * heads * (k_dim + v_dim) * itemsize
    budget = parse_size(args.budget)
    length = args.prompt_len + args.new_tokens
    slots = slot_capacity(budget, token_bytes, length)
    # Every prompt admitted in one step (as many as fit), so they all decode together.
    common = dict(
        checkpoint=str(checkpoint),
        dtype=args.dtype,
        max_prefill_tokens=args.requests * args.prompt_len,
        micro_batches="1",
    )
    paged = dict(kv_cache_bytes=args.budget, enable_chunked_prefill=False)
    print(
        f"budget {budget / 2**20:.0f} MiB, {token_bytes} bytes per token, sequences of {length} "
        f"tokens: the slot cache holds {slots}",
        flush=True,
    )
    rows = {}
    capped = dict(common, **paged, max_num_seqs=slots)
    if args.slot_checkout is not None:
        rows["slot"] = measure(
            args.slot_checkout.resolve(), dict(common, max_num_seqs=slots), slots, args
        )
        rows["slot"]["engine"] = f"slot-cache checkout {args.slot_checkout}"
        # The same sequences paged: what the gather costs against the slot cache's views.
        rows["paged_same_n"] = measure(ROOT, capped, slots, args)
        rows["paged_same_n"]["engine"] = "paged, capped at the slot cache's sequences"
    else:
        rows["slot"] = measure(ROOT, capped, slots, args)
        rows["slot"]["engine"] = "this engine capped at the slot cache's sequences"
    rows["paged"] = measure(
        ROOT, dict(common, **paged, max_num_seqs=args.requests), args.requests, args
    )
    rows["paged"]["engine"] = "paged"
    for name, row in rows.items():
        print(
            f"{name:>12}: {row['concurrent']:3d} sequences at once, decode "
            f"{row['decode_tokens_per_s']:7.1f} tokens/s ({row['decode_steps']} steps timed), "
            f"cache {row['cache_bytes'] / 2**20:.0f} MiB   [{row['engine']}]"
        )
    ratio = rows["paged"]["decode_tokens_per_s"] / rows["slot"]["decode_tokens_per_s"]
    print(
        f"paged / slot: {rows['paged']['concurrent'] / rows['slot']['concurrent']:.2f}x sequences, {ratio:.2f}x decode tokens/s"
    )
    write_result(
        args.out,
        {
            "benchmark": "kv_capacity",
            "checkpoint": str(checkpoint),
            "dtype": args.dtype,
            "budget_bytes": budget,
            "bytes_per_token": token_bytes,
            "sequence_tokens": length,
            "slot_capacity": slots,
            "results": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
