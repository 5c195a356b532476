"""bfloat16 products at a geometry's decode shapes, by each candidate the engine could take.

Issue 40 asked that the candidates include torch's oneDNN/AMX paths and inductor's CPU GEMM
templates, with moe-mesh's own kernels kept only where they measurably beat those. Each product
of a geometry's layers (q|k|v, o, an expert's gate|up and down, the LM head) is timed at 1, 8 and
32 rows, in bfloat16, by:

- `aten`: F.linear on the weight as stored (torch's CPU path: oneDNN on AMX and AVX-512 bf16);
- `onednn-packed`: oneDNN's prepacked layout (torch.ops.mkldnn, MOE_MESH_PREPACK=on's);
- `inductor`: torch.compile in max-autotune with inductor's C++ GEMM template among the
  backends (`max_autotune_gemm_backends = "CPP,ATEN"`) and freezing, so the weights are
  constants the template packs once, as a served model's are;
- `panels`: moe-mesh's kernel (common/bf16.py), the vector kernel at every size;
- `panels-tiles`: the same with AMX tiles from 8 rows (a router's dense weights), where the CPU
  has them.

Each candidate reads the same weights: per shape, as many distinct weights as fill `--pool-mib`
(decode reads each weight once a step, so a product must not find its weight in cache), run
back to back; the median of `--repeats` passes is kept. Each row gives the microseconds a
product takes and the weight bytes it reads a second. A candidate that cannot run here (no
compiler, no AMX, no oneDNN bfloat16) is recorded with the reason, and the others still run.

    .venv/bin/python -m bench.gemm_candidates [--geometry qwen3-30b-a3b-slice] [--rows 1 8 32]
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from common import runtime

runtime.configure()  # before torch loads OpenMP
from typing import Literal  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, parse_settings, write_result  # noqa: E402
from bench.geometry import GEOMETRIES, NAMES, geometry_spec  # noqa: E402
from common import bf16, linear  # noqa: E402
from common.arch import ModelSpec  # noqa: E402

CANDIDATES = ("aten", "onednn-packed", "inductor", "panels", "panels-tiles")


class Unavailable(RuntimeError):
    """A candidate this host cannot run (no oneDNN bfloat16, no kernel, no AMX)."""


class Settings(ScriptSettings):
    geometry: Literal[NAMES] = Field("small", description="model geometry (bench/geometry.py)")  # type: ignore[valid-type]
    out: Path = Field(Path("bench/results/gemm_candidates.json"), description="the JSON result")
    rows: list[int] = Field([1, 8, 32], description="rows (tokens) of each product")
    candidates: list[str] = Field(list(CANDIDATES), description="which candidates to time")
    pool_mib: int = Field(256, ge=1, description="distinct weights of a shape, MiB of bfloat16")
    repeats: int = Field(5, ge=1, description="passes over the pool; the median is kept")


def shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """A layer's products, [out, in]: attention's, one expert's and the LM head."""
    h, hd = spec.hidden_size, spec.head_dim
    return {
        "qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * hd, h),
        "o": (h, spec.num_heads * hd),
        "gate_up": (2 * spec.expert_intermediate_size, h),
        "down": (h, spec.expert_intermediate_size),
        "lm_head": (spec.vocab_size, h),
    }


def runner(name: str, weights: list[torch.Tensor], rows: int) -> Callable[[torch.Tensor], object]:
    """A function of x [rows, in] computing every weight's product, the candidate `name`'s way;
    Unavailable where it cannot run here."""
    if name == "aten":
        return lambda x: [F.linear(x, w) for w in weights]
    if name == "onednn-packed":
        if not linear._can_pack(torch.bfloat16):
            raise Unavailable("oneDNN has no bfloat16 layout on this CPU")
        packed = [linear._pack(w) for w in weights]
        return lambda x: [linear.linear(x, w) for w in packed]
    if name in ("panels", "panels-tiles"):
        if not bf16.fits(weights[0]):
            raise Unavailable("moe-mesh's kernel does not run here")
        if name == "panels-tiles" and bf16.level() < 3:
            raise Unavailable("no AMX tiles on this CPU")
        held = [bf16.Panels(w, tiles=name == "panels-tiles") for w in weights]
        return lambda x: [p(x, None) for p in held]
    return compiled(weights, rows)


def compiled(weights: list[torch.Tensor], rows: int) -> Callable[[torch.Tensor], object]:
    """inductor's: the weights as a frozen module's parameters, compiled for `rows`."""
    import torch._inductor.config as inductor

    if not shutil.which(os.environ.get("CXX") or "g++"):  # inductor's compiler (cpp.cxx)
        raise Unavailable("no C++ compiler for inductor ($CXX, else g++)")

    torch._dynamo.reset()
    inductor.freezing = True
    inductor.max_autotune = True
    inductor.max_autotune_gemm_backends = "CPP,ATEN"
    module = torch.nn.ModuleList(
        torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16) for w in weights
    ).eval()
    with torch.no_grad():
        for m, w in zip(module, weights, strict=True):
            m.weight.copy_(w)
    step = torch.compile(lambda x: [m(x) for m in module], dynamic=False)
    with torch.no_grad():
        step(torch.zeros(rows, weights[0].shape[1], dtype=torch.bfloat16))  # compiles now
    return step


def time_one(run: Callable[[torch.Tensor], object], x: torch.Tensor, count: int, repeats: int):
    with torch.no_grad():
        run(x)  # warm
        passes = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(x)
            passes.append((time.perf_counter() - start) / count)
    return statistics.median(passes)


def measure(args: Settings, spec: ModelSpec) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for shape_name, (n, k) in shapes(spec).items():
        count = max(1, (args.pool_mib << 20) // (2 * n * k))
        weights = [torch.randn(n, k, generator=gen).bfloat16() * 0.02 for _ in range(count)]
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            row: dict = {"shape": shape_name, "out": n, "in": k, "rows": rows, "weights": count}
            for name in args.candidates:
                try:
                    started = time.perf_counter()
                    run = runner(name, weights, rows)
                    setup = time.perf_counter() - started
                    seconds = time_one(run, x, count, args.repeats)
                except Exception as e:  # recorded: the other candidates still run
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    continue
                gbs = 2 * n * k / seconds / 1e9
                row[name] = {"us": round(seconds * 1e6, 1), "gb_per_s": round(gbs, 1)}
                row[name]["setup_s"] = round(setup, 1)
            timed = [c for c in args.candidates if "us" in row[c]]
            row["fastest"] = min(timed, key=lambda c: row[c]["us"], default=None)
            print(line(row, args.candidates), flush=True)
            out.append(row)
    return out


def line(row: dict, candidates: list[str]) -> str:
    times = ", ".join(
        f"{c} {row[c]['us']:.0f} us ({row[c]['gb_per_s']:.1f} GB/s)" if "us" in row[c] else f"{c} -"
        for c in candidates
    )
    return f"{row['shape']:>8} [{row['out']}, {row['in']}] x{row['rows']:>3}: {times}"


def main(argv: list[str] | None = None) -> int:
    args = parse_settings(Settings, __doc__, argv)
    unknown = sorted(set(args.candidates) - set(CANDIDATES))
    if unknown:
        raise SystemExit(f"--candidates: unknown {', '.join(unknown)}; known: {CANDIDATES}")
    spec = geometry_spec(GEOMETRIES[args.geometry])
    rows = measure(args, spec)
    result = {"benchmark": "gemm_candidates", "geometry": args.geometry, "rows": rows}
    write_result(args.out, {**result, "cpu_level": bf16.level()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
