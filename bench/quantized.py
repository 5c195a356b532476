"""Decode throughput of int8 and int4 experts against bfloat16 ones, same engine, same run.

The engine (router_service.build.build_local_engine, every expert in the process) loads the
checkpoint once per precision: bfloat16, and experts quantized by --quantize int8 / int4 (dense
weights stay bfloat16). All stay loaded and each repeat runs them in turn, so noise hits each
alike; greedy decode from the same prompts at each batch size, the median of the repeats kept.
Decode tokens/s = batch * (new_tokens - 1) / (time to generate new_tokens - time to generate 1).

Each row gives the weight bytes a token reads (bench.geometry: attention, gate, the experts its
step uses, LM head), with the experts at their quantized size (data and scales), and tokens/s
times that over the read bandwidth measured in the same run.

    .venv/bin/python -m bench.quantized [--geometry small|qwen3-30b-a3b-slice] [--batch-sizes 1,8,32]
        [--precisions bfloat16,int8,int4] [--group-size 64]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

from common import runtime

runtime.configure()  # before torch loads OpenMP
import torch  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, parse_settings, write_result  # noqa: E402
from bench.engine_vs_transformers import decode_rate, engine_generate  # noqa: E402
from bench.geometry import (  # noqa: E402
    GeometrySettings,
    bytes_per_token,
    checkpoint_for,
    expected_experts,
)
from bench.host import host_facts  # noqa: E402
from common.arch import ModelSpec, checkpoint_spec  # noqa: E402
from common.quant import Quantization  # noqa: E402
from moe_mesh.planning.measure import read_bandwidth  # noqa: E402
from router_service.build import build_local_engine  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402


class DecodeRuns(ScriptSettings):
    """How `compare` runs each engine (bench/mxfp4.py's too)."""

    batch_sizes: str = Field("1,8,32", description="comma-separated batch sizes")
    threads: int = Field(0, ge=0, description="threads to compute with; 0: torch's default")
    new_tokens: int = Field(32, ge=2, description="tokens generated per sequence")
    prompt_len: int = Field(16, ge=1, description="prompt tokens per sequence")
    repeats: int = Field(3, ge=1, description="runs of each case")


class Settings(GeometrySettings, DecodeRuns):
    out: Path | None = Field(
        None, description="the JSON result; default bench/results/quantized-GEOMETRY.json"
    )
    precisions: str = Field(
        "bfloat16,int8,int4,int8-all,int4-all",
        description="bfloat16; int8, int4 (experts); int8-all, int4-all (and the dense layers)",
    )
    group_size: int = Field(64, description="inputs per int4 scale")


def quantization(precision: str, group_size: int) -> Quantization | None:
    scheme = precision.removesuffix("-all")
    return None if scheme == "bfloat16" else Quantization(scheme, group_size)  # type: ignore[arg-type]


def token_bytes(spec: ModelSpec, q: Quantization | None, batch: int, dense: bool) -> int:
    """Weight bytes a decoded token reads: bfloat16, its experts at q's size (data and scales),
    and with `dense` every other weight at that size a weight too (the gate and norms, a few
    kilobytes, counted alike)."""
    bf16 = bytes_per_token(spec, 2, batch)
    if q is None:
        return bf16
    h, i = spec.hidden_size, spec.expert_intermediate_size
    shapes = ((2 * i, h), (h, i))
    held = sum(n * t.itemsize for shape in shapes for n, t in q.layout(shape).values())
    if dense:
        return round(bf16 * held / (2 * spec.expert_params))
    moe_layers = sum(spec.moe_layers)
    experts = expected_experts(spec.num_experts, spec.top_k, batch) * moe_layers / batch
    return round(bf16 - experts * spec.expert_params * 2 + experts * held)


def main() -> int:
    args = parse_settings(Settings, __doc__)
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = checkpoint_for(args.geometry, args.checkpoint)
    out = args.out or Path(f"bench/results/quantized-{args.geometry}.json")
    spec = checkpoint_spec(checkpoint)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    precisions = args.precisions.split(",")
    host = host_facts()
    print(f"host: {host}", flush=True)
    engines = {}
    for p in precisions:
        q = quantization(p, args.group_size)
        print(f"loading {p} ...", flush=True)
        engines[p] = build_local_engine(
            RouterSettings(
                checkpoint=checkpoint,
                dtype="bfloat16",
                max_num_seqs=max(batches),
                quantize="none" if q is None else q.scheme,
                quantize_group_size=args.group_size,
                quantize_dense=p.endswith("-all"),
            )
        )
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)

    def per_token(p: str, batch: int) -> tuple[str, int]:
        q = quantization(p, args.group_size)
        name = p if q is None else q.name + ("-all" if p.endswith("-all") else "")
        return name, token_bytes(spec, q, batch, p.endswith("-all"))

    rows = compare(engines, per_token, spec.vocab_size, batches, bandwidth, args)
    for engine in engines.values():
        engine.close()
    result = {
        "geometry": args.geometry,
        "checkpoint": str(checkpoint),
        "read_bandwidth_gb_per_s": bandwidth / 1e9,
        "host": host,
        "rows": rows,
    }
    write_result(out, result)
    return 0


def compare(
    engines: dict,
    per_token: Callable[[str, int], tuple[str, int]],
    vocab: int,
    batches: list[int],
    bandwidth: float,
    args: DecodeRuns,
) -> list[dict]:
    """Decode tokens/s of each engine at each batch size against the first's, the engines in
    turn in each repeat; `per_token(key, batch)` names an engine's precision and the weight
    bytes a token of it reads. A row per engine and batch size, printed as measured."""
    gen = torch.Generator().manual_seed(0)
    rows, first = [], next(iter(engines))
    for b in batches:
        prompts = torch.randint(0, vocab, (b, args.prompt_len), generator=gen).tolist()
        rates: dict[str, list[float]] = {p: [] for p in engines}
        tokens: dict[str, list] = {}
        for p in engines:  # one-time costs out of the timed runs
            _release_others(engines, p)
            engine_generate(engines[p], prompts, 2)
        for _ in range(args.repeats):
            for p in engines:
                _release_others(engines, p)
                rate, tokens[p] = decode_rate(
                    partial(engine_generate, engines[p]), prompts, args.new_tokens
                )
                rates[p].append(rate)
        base = statistics.median(rates[first])
        for p in engines:
            rate = statistics.median(rates[p])
            name, size = per_token(p, b)
            row = {
                "precision": name,
                "batch": b,
                "tokens_per_s": rate,
                "vs_first": rate / base,
                "bytes_per_token": size,
                "bandwidth_share": rate * size / bandwidth,
                "greedy_same_as_first": tokens[p] == tokens[first],
            }
            rows.append(row)
            print(
                f"batch {b:>3} {name:>9}: {rate:7.1f} tok/s  {row['vs_first']:.2f}x "
                f"{per_token(first, b)[0]}  {size / 1e6:.1f} MB/token  "
                f"{row['bandwidth_share']:.0%} of read bandwidth  "
                f"same greedy tokens: {row['greedy_same_as_first']}",
                flush=True,
            )
    return rows


def _release_others(engines: dict, running: str) -> None:
    """Idle OpenMP teams of the other engines spin on these cores: end them first."""
    runtime.release_openmp_threads()
    for p, engine in engines.items():
        if p != running:
            engine.model.compute.release_openmp_threads()


if __name__ == "__main__":
    raise SystemExit(main())
