"""Where a batch-1 decode step's time goes, phase by phase, in each precision: the one-call step
of a build of the kernels that times its phases on thread 0 (MOE_MESH_STEP_PHASES=1,
common/kernel_build.py; the phases are decode_kernel.c's, each with its barrier's wait). Per
token: each phase's microseconds, the products' and the rest's sums, and the decode's wall time
(its bursts' Python between them included). Shares of a token are what say whether a precision
is bound by its products or by the work between them (docs/performance.md#host-d). Where the
step's threads prepare what they wrote, "o inputs", "silu" and a lone token's expert inputs have
no phase: their work is timed in "attention", "gate up" and "router", the last two counted as
products.

    .venv/bin/python -m bench.step_phases [--geometry qwen3-30b-a3b-slice] \\
        [--precisions bfloat16,int8-all,int4-all] [--threads N]
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from pydantic import Field

from common import runtime

runtime.configure()

import torch  # noqa: E402

from bench import parse_settings, write_result  # noqa: E402
from bench.engine_vs_transformers import engine_generate  # noqa: E402
from bench.geometry import GeometrySettings, checkpoint_for  # noqa: E402
from bench.quantized import quantization  # noqa: E402
from common import bf16  # noqa: E402
from router_service.build import build_local_engine  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402

PHASES = (  # decode_kernel.c's enum, in order
    "embed", "qkv", "kv prepare", "attention", "o tiles", "o inputs", "o", "post norm",
    "router", "route", "expert inputs", "gate up", "silu", "down", "combine", "next norm",
    "lm head",
)  # fmt: skip
PRODUCTS = ("qkv", "o", "router", "gate up", "down", "lm head")  # the phases that read weights
PROMPT = list(range(5, 21))


class Settings(GeometrySettings):
    out: Path = Field(Path("bench/results/step_phases.json"), description="the JSON result")
    precisions: str = Field(
        "bfloat16,int8-all,int4-all", description="as bench/quantized.py takes them"
    )
    group_size: int = Field(64, description="inputs per int4 scale")
    threads: int = Field(0, ge=0, description="threads to compute with; 0: torch's default")
    new_tokens: int = Field(65, ge=9, le=1024, description="tokens generated (one prefill)")


def timers() -> ctypes.Array:
    """The phase build's seconds per phase, or exit 2 where the kernels are not that build."""
    lib = bf16.library()
    count = getattr(lib, "moe_step_phase_count", None)
    if count is None or count() != len(PHASES):
        raise SystemExit("the kernels here are not the phase-timing build (needs a C compiler)")
    return (ctypes.c_double * len(PHASES)).in_dll(lib, "moe_step_phases")


def decode(engine, n: int) -> tuple[float, int]:
    """One request's decode: seconds from its first token (the prefill's) to its last, and the
    tokens in between. Timed within one run, so a slow prefill cannot make it negative, as taking
    one run's prefill from another's whole did on a busy host."""
    marks: list[tuple[float, int]] = []
    engine_generate(engine, [PROMPT], n, marks)
    (start, first), (end, last) = marks[0], marks[-1]
    return end - start, last - first


def measure(engine, seconds: ctypes.Array, new_tokens: int) -> dict:
    """Microseconds a decode token spends in each phase, and the decode's wall time a token, of
    the fastest of three runs."""
    decode(engine, 4)  # one-time costs
    runs = []
    for _ in range(3):
        ctypes.memset(seconds, 0, ctypes.sizeof(seconds))
        runs.append((*decode(engine, new_tokens), list(seconds)))
    wall, tokens, spent = min(runs)
    phases = {p: round(spent[i] / tokens * 1e6, 1) for i, p in enumerate(PHASES)}
    products = sum(phases[p] for p in PRODUCTS)
    return {
        "phases_us": phases,
        "products_us": round(products, 1),
        "between_us": round(sum(phases.values()) - products, 1),
        "decode_us": round(wall / tokens * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    os.environ["MOE_MESH_STEP_PHASES"] = "1"  # before the kernels are first loaded (timers())
    args = parse_settings(Settings, __doc__, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seconds = timers()
    checkpoint = checkpoint_for(args.geometry, args.checkpoint)
    rows = []
    for p in args.precisions.split(","):
        q = quantization(p, args.group_size)
        engine = build_local_engine(
            RouterSettings(
                checkpoint=checkpoint,
                dtype="bfloat16",
                max_num_seqs=1,
                quantize="none" if q is None else q.scheme,
                quantize_group_size=args.group_size,
                quantize_dense=p.endswith("-all"),
            )
        )
        try:
            row = {"precision": p, **measure(engine, seconds, args.new_tokens)}
        finally:
            engine.close()
        rows.append(row)
        busy = ", ".join(f"{k} {v:.0f}" for k, v in row["phases_us"].items() if v >= 0.5)
        print(
            f"{p}: {row['decode_us']:.0f} us a token; products {row['products_us']:.0f}, "
            f"between them {row['between_us']:.0f} ({busy})",
            flush=True,
        )
    result = {"checkpoint": str(checkpoint), "threads": torch.get_num_threads(), "rows": rows}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
