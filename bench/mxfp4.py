"""Decode throughput of MXFP4 experts computed from their codes against the same experts
dequantized to bfloat16, same engine, same run.

gpt-oss publishes its experts in MXFP4 (common/mxfp4.py). Served in bfloat16 on a CPU with the C
kernels, the router computes them from their 4-bit codes; the baseline is the same model with its
experts stored dequantized (moe_mesh.dev.expert_layouts.dequantize_mxfp4: each weight exactly
what its code and scale mean), held as bfloat16 panels. Both checkpoints are the `small` gpt-oss
preset (hidden 1024, 8 layers, 8 experts of FFN 1024, top-2), created and cached under .cache/
on first use. Rows as bench/quantized.py's: tokens/s, the weight bytes a token reads (MXFP4
experts at half a byte a weight and a bfloat16 scale a block of 32), the share of the read
bandwidth measured in the same run, and whether greedy tokens agree.

gpt-oss's decode step runs op by op (its attention sinks and biases keep it out of the one-call
step), so the engine rows carry that fixed cost. The products alone come first: one expert's two
products at gpt-oss-20b's shapes (hidden 2880, FFN 2880), random codes and scales, MXFP4 panels
against bfloat16 panels of the same weights, EXPERTS experts in turn so that the weights stream
from memory as a decode step's do.

    .venv/bin/python -m bench.mxfp4 [--batch-sizes 1,8,32] [--repeats 3]
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

from common import runtime

runtime.configure()  # before torch loads OpenMP
import torch  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import parse_settings, write_result  # noqa: E402
from bench.geometry import ROOT, built_whole, bytes_per_token  # noqa: E402
from bench.host import host_facts  # noqa: E402
from bench.quantized import DecodeRuns, compare, token_bytes  # noqa: E402
from common import bf16  # noqa: E402
from common.arch import checkpoint_spec  # noqa: E402
from common.mxfp4 import FORMAT, computable, dequantize, panels  # noqa: E402
from moe_mesh.planning.measure import read_bandwidth  # noqa: E402
from router_service.build import build_local_engine  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402

CHECKPOINT = ROOT / ".cache/bench-gpt-oss-small-mxfp4"
SHAPES = ((5760, 2880), (2880, 2880))  # gpt-oss-20b's gate_up and down [out, in]
EXPERTS = 8  # cycled: ~70 MiB of MXFP4 and ~250 MiB of bfloat16 weights, past the L3


class Settings(DecodeRuns):
    checkpoint: Path = Field(
        CHECKPOINT, description="an MXFP4 gpt-oss checkpoint; the default is created if missing"
    )
    out: Path = Field(Path("bench/results/mxfp4.json"), description="the JSON result")
    products: bool = Field(True, description="time the products alone first (a few seconds)")


def checkpoints(path: Path) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, its dequantized twin beside it), each created if missing."""
    from moe_mesh.dev.create_checkpoint import create_checkpoint
    from moe_mesh.dev.expert_layouts import dequantize_mxfp4

    twin = path.with_name(path.name + "-dequantized")
    if not (path / "config.json").exists():
        if path != CHECKPOINT:
            raise SystemExit(f"{path} holds no config.json: not a checkpoint")
        print(f"[mxfp4] creating the small gpt-oss preset in MXFP4 at {path}", flush=True)
        built_whole(
            path,
            lambda partial: create_checkpoint(
                partial,
                "gpt_oss",
                "small",
                seed=0,
                quantize="mxfp4",
                dtype="bfloat16",
                progress=True,
            ),
        )
    if not (twin / "config.json").exists():
        print(f"[mxfp4] writing its experts dequantized at {twin}", flush=True)

        def dequantized(partial: Path) -> None:
            shutil.copytree(path, partial)
            dequantize_mxfp4(partial)

        built_whole(twin, dequantized)
    return path, twin


def products(batches: list[int], repeats: int, bandwidth: float) -> list[dict]:
    """Seconds of an expert's two products at SHAPES, MXFP4 against bfloat16, at each batch."""
    gen = torch.Generator().manual_seed(0)
    held: dict[str, list] = {"mxfp4": [], "bfloat16": []}
    for _ in range(EXPERTS):
        for out, k in SHAPES:
            blocks = torch.randint(0, 256, (out, k // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(118, 130, (out, k // 32), dtype=torch.uint8, generator=gen)
            held["mxfp4"].append(panels(blocks, scales, "random"))
            held["bfloat16"].append(bf16.Panels(dequantize(blocks, scales, torch.bfloat16)))
    rows = []
    for b in batches:
        x = {k: torch.randn(b, k, generator=gen).bfloat16() for _, k in SHAPES}
        times: dict[str, list[float]] = {name: [] for name in held}
        for _ in range(max(repeats, 3)):
            for name, weights in held.items():
                start = time.perf_counter()
                for w in weights:
                    w(x[w.shape[1]])
                times[name].append((time.perf_counter() - start) / EXPERTS)
        seconds = {name: statistics.median(t) for name, t in times.items()}
        for name, weights in held.items():
            size = sum(w.nbytes for w in weights) / EXPERTS
            row = {
                "precision": name,
                "batch": b,
                "expert_ms": seconds[name] * 1e3,
                "vs_bfloat16": seconds["bfloat16"] / seconds[name],
                "bytes_per_expert": size,
                "bandwidth_share": size / seconds[name] / bandwidth,
            }
            rows.append(row)
            print(
                f"products, batch {b:>3} {name:>9}: {row['expert_ms']:6.2f} ms an expert  "
                f"{row['vs_bfloat16']:.2f}x bfloat16  {size / 2**20:5.1f} MiB  "
                f"{row['bandwidth_share']:.0%} of read bandwidth",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_settings(Settings, __doc__, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not computable(torch.bfloat16, bf16.COLUMNS):
        raise SystemExit("no C compiler or no AVX2 here: MXFP4 experts would be dequantized")
    path, twin = checkpoints(args.checkpoint)
    spec = checkpoint_spec(path)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    host = host_facts()
    print(f"host: {host}", flush=True)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    expert_products = products(batches, args.repeats, bandwidth) if args.products else []
    engines = {}
    for name, checkpoint in (("bfloat16", twin), ("mxfp4", path)):
        print(f"loading {name} ({checkpoint}) ...", flush=True)
        engines[name] = build_local_engine(
            RouterSettings(checkpoint=checkpoint, dtype="bfloat16", max_num_seqs=max(batches))
        )

    def per_token(name: str, batch: int) -> tuple[str, int]:
        if name == "bfloat16":
            return name, bytes_per_token(spec, 2, batch)
        return name, token_bytes(spec, FORMAT, batch, dense=False)

    rows = compare(engines, per_token, spec.vocab_size, batches, bandwidth, args)
    for engine in engines.values():
        engine.close()
    result = {
        "checkpoint": str(path),
        "read_bandwidth_gb_per_s": bandwidth / 1e9,
        "host": host,
        "products": expert_products,
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
