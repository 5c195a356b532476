"""Decode throughput of the moe-mesh engine vs transformers `generate`, same checkpoint, same run.

Both generate greedily from the same prompts at batch 1, 8 and 32, in float32 and in bfloat16
(each side computing in that dtype); runs alternate engine / transformers and the median of the
repeats is kept, so machine noise hits both sides alike. Before each side runs, the other side's
OpenMP workers are ended (runtime.release_openmp_threads): two idle teams on one host slow both.
Decode tokens/s = batch * (new_tokens - 1) / (time to generate new_tokens - time to generate 1).

Batch-1 decode reads every weight a token uses once per token, so its rate is bounded by memory
bandwidth: the run measures this machine's read bandwidth (all threads summing a buffer far
larger than the last-level cache) and prints the engine's batch-1 rate × bytes read per token
(the model's sizes: attention, gate, top-k experts, LM head per token) as a share of it.

    .venv/bin/python -m bench.engine_vs_transformers [--checkpoint DIR] [--batch-sizes 1,8,32]
        [--dtypes float32,bfloat16]

(from the checkout root, where `bench` imports as a package)
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from common import runtime

runtime.configure()  # before torch loads OpenMP
import torch  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, ensure_checkpoint, parse_settings, write_result  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from moe_mesh.planning.measure import read_bandwidth  # noqa: E402
from router_service.build import build_local_engine  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402


def engine_generate(engine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    runtime.release_openmp_threads()  # transformers' team, on this thread
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    out: dict[str, list[int]] = {}

    async def drive() -> None:
        while engine.has_unfinished():
            for o in await engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)

    start = time.perf_counter()
    asyncio.run(drive())
    return time.perf_counter() - start, [out[f"b{i}"] for i in range(len(prompts))]


def hf_generate(model, engine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    engine.model.compute.release_openmp_threads()  # the engine's team, on its compute thread
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()


def decode_rate(run, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    t1, _ = run(prompts, 1)
    tn, tokens = run(prompts, n)
    return len(prompts) * (n - 1) / max(tn - t1, 1e-9), tokens


def bytes_per_token(spec, itemsize: int) -> int:
    """Weight bytes one decoding token reads: per layer attention, norms, gate, its top-k experts
    (plus shared expert / dense MLP), and the LM head. The KV cache of a short context is noise."""
    h, hd = spec.hidden_size, spec.head_dim
    attention = (spec.num_heads + 2 * spec.num_kv_heads) * hd * h + h * spec.num_heads * hd + 2 * h
    params = spec.vocab_size * h + h  # LM head, final norm
    for moe in spec.moe_layers:
        params += attention
        if moe:
            params += spec.num_experts * h + spec.top_k * 3 * spec.expert_intermediate_size * h
            params += 3 * (spec.shared_expert_intermediate_size or 0) * h
        else:
            params += 3 * spec.dense_intermediate_size * h
    return params * itemsize


def measure(
    engine, hf, dtype_name: str, b: int, gen, args: ScriptSettings, bandwidth: float
) -> dict:
    """Decode tokens/s of the engine and of transformers at batch `b`, medians of the repeats."""
    spec = engine.model.spec
    prompts = torch.randint(3, spec.vocab_size, (b, args.prompt_len), generator=gen).tolist()
    ours, theirs, same = [], [], True
    # One-time costs (kernel set-up for these shapes) must not land in a timed run.
    engine_generate(engine, prompts, 2)
    hf_generate(hf, engine, prompts, 2)
    for _ in range(args.repeats):
        rate, a = decode_rate(partial(engine_generate, engine), prompts, args.new_tokens)
        ours.append(rate)
        rate, h = decode_rate(partial(hf_generate, hf, engine), prompts, args.new_tokens)
        theirs.append(rate)
        same = same and a == h
    row = {
        "dtype": dtype_name,
        "batch": b,
        "engine_tokens_per_s": statistics.median(ours),
        "transformers_tokens_per_s": statistics.median(theirs),
        "greedy_outputs_identical": same,
        "engine_serial_max_tokens": engine.model.serial_max_tokens,
    }
    row["ratio"] = row["engine_tokens_per_s"] / row["transformers_tokens_per_s"]
    line = (
        f"{dtype_name:>8} batch {b:>3}: engine {row['engine_tokens_per_s']:7.1f} tok/s   "
        f"transformers {row['transformers_tokens_per_s']:7.1f} tok/s   "
        f"ratio {row['ratio']:.2f}x   identical={same}"
    )
    if b == 1:
        per_token = bytes_per_token(spec, getattr(torch, dtype_name).itemsize)
        row["bytes_per_token"] = per_token
        row["bandwidth_share"] = row["engine_tokens_per_s"] * per_token / bandwidth
        line += f"   {row['bandwidth_share']:.0%} of memory bandwidth"
    print(line, flush=True)
    return row


class Settings(ScriptSettings):
    out: Path = Field(
        Path("bench/results/engine_vs_transformers.json"), description="the JSON result"
    )
    batch_sizes: str = Field("1,8,32", description="comma-separated batch sizes")
    dtypes: str = Field("float32,bfloat16", description="comma-separated dtypes")
    new_tokens: int = Field(32, ge=1, description="tokens generated per sequence")
    prompt_len: int = Field(16, ge=1, description="prompt tokens per sequence")
    repeats: int = Field(3, ge=1, description="runs of each case")


def main() -> int:
    args = parse_settings(Settings, __doc__)

    ensure_checkpoint(args.checkpoint)
    from transformers import AutoModelForCausalLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = read_bandwidth()
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        hf = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).eval()
        engine = build_local_engine(
            RouterSettings(checkpoint=args.checkpoint, max_num_seqs=max(batches), dtype=dtype_name)
        )
        spec = engine.model.spec
        # Measured at start-up (common.linear.serial_tokens): it moves with the host's speed.
        serial = engine.model.serial_max_tokens
        print(f"{dtype_name}: the engine decodes up to {serial} tokens on one thread", flush=True)
        gen = torch.Generator().manual_seed(0)
        for b in batches:
            rows.append(measure(engine, hf, dtype_name, b, gen, args, bandwidth))
        engine.close()

    write_result(
        args.out,
        {
            "benchmark": "engine_vs_transformers_decode",
            "checkpoint": str(args.checkpoint),
            "model": {
                "family": spec.family,
                "layers": spec.num_layers,
                "hidden": spec.hidden_size,
                "experts": spec.num_experts,
                "top_k": spec.top_k,
            },
            "new_tokens": args.new_tokens,
            "prompt_len": args.prompt_len,
            "repeats": args.repeats,
            "memory_read_bandwidth_bytes_per_s": bandwidth,
            "results": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
