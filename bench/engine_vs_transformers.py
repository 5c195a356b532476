"""Decode throughput of the moe-mesh engine vs transformers `generate`, same checkpoint, same run.

Both generate greedily from the same prompts at batch 1, 8 and 32, in float32 and in bfloat16
(each side computing in that dtype); the median of the repeats is kept. Before each side runs,
the other side's OpenMP workers are ended (runtime.release_openmp_threads): two idle teams on one
host slow both. Decode tokens/s = batch * (new_tokens - 1) / (time to generate new_tokens - time to
generate 1).

`--geometry` picks the model (bench/geometry.py: `small`, or a slice of Qwen3-30B-A3B or
Mixtral-8x7B at their real layer shapes), created under .cache/ on first use. Where both sides
fit in memory at once (twice the weights at the compute dtype, plus a margin, under the host's
MemAvailable; `--resident auto`), runs alternate engine / transformers, so machine noise hits
both alike. Where they do not (the slices in float32 on a 23 GB host), one side is loaded at a
time: the engine runs every batch, is closed and freed, then transformers loads and runs them,
and the greedy tokens are compared afterwards.

Decode reads weights, so its rate is bounded by memory bandwidth: the run measures this machine's
read bandwidth (all threads reading four times the L3, 256 MiB to 2 GiB: the faster of torch's
sum and moe-mesh's bfloat16 kernel, moe_mesh/planning/measure.py's read_bandwidth), and each row
gives the weight bytes read per token (bench.geometry.bytes_per_token: attention, gate, the
experts a step's tokens use, LM head; at batch > 1 the expected distinct experts under uniform
routing, shared by the batch) and each side's tokens/s times that as a share of the bandwidth.

    .venv/bin/python -m bench.engine_vs_transformers [--geometry small] [--checkpoint DIR]
        [--batch-sizes 1,8,32] [--dtypes float32,bfloat16] [--resident auto|both|one]

(from the checkout root, where `bench` imports as a package)
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

from common import runtime

runtime.configure()  # before torch loads OpenMP
import torch  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import parse_settings, write_result  # noqa: E402
from bench.geometry import GeometrySettings, bytes_per_token, checkpoint_for, model_params  # noqa: E402
from common.arch import ModelSpec, checkpoint_spec  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from moe_mesh.planning.measure import read_bandwidth  # noqa: E402
from router_service.build import build_local_engine  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402

Run = Callable[[list[list[int]], int], tuple[float, list[list[int]]]]


def engine_generate(
    engine, prompts: list[list[int]], n: int, marks: list[tuple[float, int]] | None = None
) -> tuple[float, list[list[int]]]:
    """Seconds to generate n tokens greedily for each prompt, and the tokens. `marks`, where
    given, gets each step's end that brought tokens: (its time, the tokens so far)."""
    runtime.release_openmp_threads()  # transformers' team, on this thread
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    out: dict[str, list[int]] = {}

    async def drive() -> None:
        count = 0
        while engine.has_unfinished():
            for o in await engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                count += len(o.new_token_ids)
            if marks is not None and count:
                marks.append((time.perf_counter(), count))

    start = time.perf_counter()
    asyncio.run(drive())
    return time.perf_counter() - start, [out[f"b{i}"] for i in range(len(prompts))]


def hf_generate(model, engine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    if engine is not None:  # the engine's team, on its compute thread
        engine.model.compute.release_openmp_threads()
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


def decode_rate(run: Run, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    t1, _ = run(prompts, 1)
    tn, tokens = run(prompts, n)
    return len(prompts) * (n - 1) / max(tn - t1, 1e-9), tokens


def load_engine(checkpoint: Path, dtype_name: str, batches: list[int]):
    engine = build_local_engine(
        RouterSettings(checkpoint=checkpoint, max_num_seqs=max(batches), dtype=dtype_name)
    )
    # Measured at start-up (common.linear.serial_tokens): it moves with the host's speed.
    serial = engine.model.serial_max_tokens
    print(f"{dtype_name}: the engine decodes up to {serial} tokens on one thread", flush=True)
    return engine


def load_hf(checkpoint: Path, dtype_name: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype_name)).eval()


def make_row(
    dtype_name: str,
    b: int,
    ours: list[float],
    theirs: list[float],
    same: bool,
    serial: int,
    spec: ModelSpec,
    bandwidth: float,
) -> dict:
    """One batch's figures: medians, the ratio, the bytes a token reads and each side's share of
    the read bandwidth."""
    per_token = bytes_per_token(spec, getattr(torch, dtype_name).itemsize, b)
    row = {
        "dtype": dtype_name,
        "batch": b,
        "engine_tokens_per_s": statistics.median(ours),
        "transformers_tokens_per_s": statistics.median(theirs),
        "greedy_outputs_identical": same,
        "engine_serial_max_tokens": serial,
        "bytes_per_token": per_token,
    }
    row["ratio"] = row["engine_tokens_per_s"] / row["transformers_tokens_per_s"]
    row["bandwidth_share"] = row["engine_tokens_per_s"] * per_token / bandwidth
    row["transformers_bandwidth_share"] = row["transformers_tokens_per_s"] * per_token / bandwidth
    print(
        f"{dtype_name:>8} batch {b:>3}: engine {row['engine_tokens_per_s']:7.1f} tok/s   "
        f"transformers {row['transformers_tokens_per_s']:7.1f} tok/s   "
        f"ratio {row['ratio']:.2f}x   identical={same}   {per_token / 1e6:.1f} MB/token: "
        f"engine {row['bandwidth_share']:.0%}, transformers "
        f"{row['transformers_bandwidth_share']:.0%} of read bandwidth",
        flush=True,
    )
    return row


def alternating(checkpoint: Path, dtype_name: str, prompts: dict, args, spec, bandwidth) -> list:
    """Both sides loaded; each repeat runs the engine then transformers."""
    hf = load_hf(checkpoint, dtype_name)
    engine = load_engine(checkpoint, dtype_name, list(prompts))
    ours_run: Run = partial(engine_generate, engine)
    theirs_run: Run = partial(hf_generate, hf, engine)
    rows = []
    for b, p in prompts.items():
        ours, theirs, same = [], [], True
        # One-time costs (kernel set-up for these shapes) must not land in a timed run.
        ours_run(p, 2)
        theirs_run(p, 2)
        for _ in range(args.repeats):
            rate, a = decode_rate(ours_run, p, args.new_tokens)
            ours.append(rate)
            rate, h = decode_rate(theirs_run, p, args.new_tokens)
            theirs.append(rate)
            same = same and a == h
        serial = engine.model.serial_max_tokens
        rows.append(make_row(dtype_name, b, ours, theirs, same, serial, spec, bandwidth))
    engine.close()
    return rows


def one_side(run: Run, prompts: dict, args) -> dict[int, tuple[list[float], list[list[int]]]]:
    """Every batch's rates and (last) tokens from one side."""
    out = {}
    for b, p in prompts.items():
        run(p, 2)  # one-time costs, as above
        rates, tokens = [], []
        for _ in range(args.repeats):
            rate, tokens = decode_rate(run, p, args.new_tokens)
            rates.append(rate)
        out[b] = (rates, tokens)
    return out


def one_at_a_time(checkpoint: Path, dtype_name: str, prompts: dict, args, spec, bandwidth) -> list:
    """The engine's runs, the engine freed, then transformers' runs: never both in memory."""
    engine = load_engine(checkpoint, dtype_name, list(prompts))
    serial = engine.model.serial_max_tokens
    ours = one_side(partial(engine_generate, engine), prompts, args)
    engine.close()
    del engine
    release_memory()
    hf = load_hf(checkpoint, dtype_name)
    theirs = one_side(partial(hf_generate, hf, None), prompts, args)
    del hf
    release_memory()
    rows = []
    for b in prompts:
        (ours_rates, a), (theirs_rates, h) = ours[b], theirs[b]
        rows.append(
            make_row(dtype_name, b, ours_rates, theirs_rates, a == h, serial, spec, bandwidth)
        )
    return rows


def release_memory() -> None:
    """Free what nothing references and hand it back to the system: glibc keeps the freed heap
    of many few-MiB tensors (an engine's experts), measured at the Qwen3 slice: 6.5 GB resident
    after the engine was closed and collected, 0.3 GB after malloc_trim."""
    gc.collect()
    runtime.return_freed_heap()


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def both_fit(spec: ModelSpec, dtype_name: str) -> tuple[bool, int, int]:
    """Whether the engine and transformers fit in memory together: twice the weights at the
    compute dtype, 40% more for what loading holds transiently, and 2 GiB for the rest (measured
    at the Qwen3 slice in bfloat16, 5.05 GB of weights: peak RSS 13.9 GB with both loaded)."""
    weights = model_params(spec) * getattr(torch, dtype_name).itemsize
    need = int(2 * weights * 1.4) + (2 << 30)
    return need < (free := mem_available()), need, free


class Settings(GeometrySettings):
    out: Path = Field(
        Path("bench/results/engine_vs_transformers.json"), description="the JSON result"
    )
    batch_sizes: str = Field("1,8,32", description="comma-separated batch sizes")
    dtypes: str = Field("float32,bfloat16", description="comma-separated dtypes")
    resident: Literal["auto", "both", "one"] = Field(
        "auto",
        description="both: engine and transformers loaded together, runs alternate; one: "
        "one side at a time; auto: both if they fit in MemAvailable",
    )
    new_tokens: int = Field(32, ge=2, description="tokens generated per sequence")
    prompt_len: int = Field(16, ge=1, description="prompt tokens per sequence")
    repeats: int = Field(3, ge=1, description="runs of each case")


def main() -> int:
    args = parse_settings(Settings, __doc__)
    checkpoint = checkpoint_for(args.geometry, args.checkpoint)
    spec = checkpoint_spec(checkpoint)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = read_bandwidth(repeats=20)  # best of 20: other processes may be reading too
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows, modes = [], {}
    for dtype_name in args.dtypes.split(","):
        gen = torch.Generator().manual_seed(0)
        prompts = {
            b: torch.randint(3, spec.vocab_size, (b, args.prompt_len), generator=gen).tolist()
            for b in batches
        }
        fits, need, free = both_fit(spec, dtype_name)
        together = args.resident == "both" or (args.resident == "auto" and fits)
        modes[dtype_name] = "both" if together else "one"
        print(
            f"{dtype_name}: both sides need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB "
            f"available: {'both resident, runs alternate' if together else 'one side at a time'}",
            flush=True,
        )
        measure = alternating if together else one_at_a_time
        rows += measure(checkpoint, dtype_name, prompts, args, spec, bandwidth)
        release_memory()  # this dtype's models, before the next dtype's load
    write_result(args.out, result(args, checkpoint, spec, bandwidth, modes, rows))
    return 0


def result(args, checkpoint: Path, spec: ModelSpec, bandwidth: float, modes, rows) -> dict:
    return {
        "benchmark": "engine_vs_transformers_decode",
        "geometry": args.geometry,
        "checkpoint": str(checkpoint),
        "model": {
            "family": spec.family,
            "layers": spec.num_layers,
            "hidden": spec.hidden_size,
            "experts": spec.num_experts,
            "expert_intermediate": spec.expert_intermediate_size,
            "top_k": spec.top_k,
            "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "vocab": spec.vocab_size,
            "params": model_params(spec),
        },
        "resident": modes,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
        "memory_read_bandwidth_bytes_per_s": bandwidth,
        "results": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
