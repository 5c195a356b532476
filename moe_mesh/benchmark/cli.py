"""`moe-mesh bench`: serving benchmark (after vLLM's benchmark_serving) against a running gateway or
set-ups it starts itself; a JSON report, a summary table and a throughput-vs-TPOT picture."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

from common.cli import add_settings_arguments, settings_from_args
from common.errors import InvalidArgumentError
from moe_mesh.benchmark import client, plot, setups
from moe_mesh.benchmark.load import LoadPoint, run_point
from moe_mesh.benchmark.settings import BenchSettings
from moe_mesh.benchmark.stats import Slo, summarize
from moe_mesh.benchmark.workload import (
    MEDIAN_INPUT_TOKENS,
    MEDIAN_OUTPUT_TOKENS,
    SIGMA,
    BenchRequest,
    build_workload,
)
from moe_mesh.ops.ready import read_ready_file
from moe_mesh.ops.tables import table

DEFAULT_CONCURRENCY = "1,2,4,8"


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,...; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R or R,R,... (or inf); got {text!r}") from None
    if not values or min(values) <= 0 or any(math.isnan(v) for v in values):
        raise argparse.ArgumentTypeError(f"every rate must be > 0, got {text!r}")
    return values


def _setup(text: str) -> setups.Setup:
    try:
        return setups.parse_setup(text)
    except InvalidArgumentError as e:  # argparse reports its own type errors: usage, exit 2
        raise argparse.ArgumentTypeError(str(e).removeprefix("--setup: ")) from None


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "bench",
        help="serving benchmark: throughput, TTFT, TPOT, goodput against a mesh",
        description="Stream random-token completions through a gateway's OpenAI-compatible API at "
        "each load level and report throughput, TTFT/TPOT/ITL percentiles and goodput, as JSON, "
        "a table and a throughput-vs-TPOT PNG.",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running gateway's HTTP API, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--ready-file",
        type=Path,
        help="the file `moe-mesh up --ready-file` wrote (its gateway_http)",
    )
    target.add_argument(
        "--setup",
        action="append",
        type=_setup,
        metavar="NAME=FLAGS",
        help="start `moe-mesh up FLAGS` on --checkpoint, benchmark it, stop it (repeatable; one after "
        "another), e.g. 'monolithic=--expert-services 0' or 'grpc=--router-arg=--fast-path=off'",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_positive_ints,
        help=f"closed loop: clients each sending its next request when the last ends; a list sweeps "
        f"(default {DEFAULT_CONCURRENCY})",
    )
    load.add_argument(
        "--request-rate",
        type=_rates,
        help="open loop: Poisson arrivals per second ('inf': all at once); a list sweeps",
    )
    add_settings_arguments(p, BenchSettings)
    p.set_defaults(func=run_bench)


def _points(args: argparse.Namespace) -> list[LoadPoint]:
    if args.request_rate:
        return [LoadPoint(request_rate=r) for r in args.request_rate]
    return [
        LoadPoint(concurrency=c) for c in args.concurrency or _positive_ints(DEFAULT_CONCURRENCY)
    ]


def _ready_url(path: Path) -> str:
    mesh = read_ready_file(path, "gateway_http")
    return ("https://" if "tls" in mesh else "http://") + mesh["gateway_http"]


async def _bench_target(
    url: str, name: str, args: argparse.Namespace, report: dict, ready: Path | None = None
) -> dict:
    """Every load point against the gateway at `url` (of the mesh `ready` describes, if known):
    the set-up's entry of the report."""
    from tqdm import tqdm

    from moe_mesh.ops.client import client_tls

    url = client.base_url(url)
    tls = client_tls(ready, args.tls_ca)  # an https gateway: its CA
    async with client.session(args.max_duration_s + 60, tls) as s:
        model = await client.fetch_model(s, url)
        max_len = min(args.max_model_len or model.max_model_len, model.max_model_len)
        requests = build_workload(
            args.num_requests,
            args.seed,
            model.vocab_size,
            max_len,
            scale=args.scale,
            input_len=args.input_len,
            output_len=args.output_len,
        )
        report["model"] = {"id": model.id, "max_model_len": max_len, "vocab_size": model.vocab_size}
        report["workload"].update(
            input_tokens=sum(r.input_len for r in requests),
            output_tokens=sum(r.output_len for r in requests),
        )
        for r in requests[: args.warmup_requests]:
            await client.stream_completion(s, url, model.id, _warmup(r), time.perf_counter())
        points = []
        for point in _points(args):
            bar = tqdm(
                total=len(requests),
                desc=f"{name} {point.label}",
                unit="req",
                file=sys.stderr,
                disable=args.quiet or not sys.stderr.isatty(),
                leave=False,
            )
            with bar:
                results, duration = await run_point(
                    s, url, model.id, requests, point, args.max_duration_s, args.seed,
                    on_done=lambda r, bar=bar: bar.update(1),
                )  # fmt: skip
            summary = summarize(results, duration, _slo(args), sum(r.output_len for r in requests))
            points.append({"load": point.label, **point.as_json(), **summary})
    return {"name": name, "url": url, "points": points}


def _warmup(r: BenchRequest) -> BenchRequest:
    return BenchRequest(r.prompt_token_ids, min(r.output_len, 4))


def _slo(args: argparse.Namespace) -> Slo:
    return Slo(args.slo_ttft_ms, args.slo_tpot_ms)


def render(report: dict) -> str:
    """The summary table: one row per set-up and load level."""

    def f(v: float | None, digits: int = 1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    rows = [
        [
            s["name"],
            p["load"],
            f"{p['completed']}/{p['requests']}",
            f(p["request_throughput"], 2),
            f(p["output_throughput"]),
            f(p["ttft_ms"]["p50"]),
            f(p["ttft_ms"]["p99"]),
            f(p["tpot_ms"]["p50"]),
            f(p["tpot_ms"]["p99"]),
            f(p["itl_ms"]["p50"]),
            f(p["goodput"], 2),
        ]
        for s in report["setups"]
        for p in s["points"]
    ]
    header = ["setup", "load", "done", "req/s", "out tok/s", "TTFT p50", "TTFT p99"]
    header += ["TPOT p50", "TPOT p99", "ITL p50", "goodput/s"]
    slo = report["slo"]
    return (
        table(header, rows)
        + f"\n(ms; goodput: requests/s with TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms)"
    )


def run_bench(args: argparse.Namespace) -> int:
    settings = settings_from_args(BenchSettings, args)
    args = argparse.Namespace(**{**vars(args), **settings.model_dump()})
    if args.setup and args.checkpoint is None:
        raise InvalidArgumentError("--checkpoint", "required with --setup")
    if args.setup and len({s.name for s in args.setup}) < len(args.setup):
        raise InvalidArgumentError("--setup", "set-up names must differ")
    folder = Path(".cache") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out = args.out or folder / "bench.json"
    png = args.png or out.with_suffix(".png")
    report = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "workload": {
            "num_requests": args.num_requests,
            "seed": args.seed,
            "scale": args.scale,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "median_input_tokens": MEDIAN_INPUT_TOKENS,
            "median_output_tokens": MEDIAN_OUTPUT_TOKENS,
            "sigma": SIGMA,
        },
        "setups": [],
    }

    def record(entry: dict) -> None:
        report["setups"].append(entry)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")  # each set-up lands as soon as it ends

    if args.setup:
        for setup in args.setup:
            if not args.quiet:
                print(
                    f"==> set-up {setup.name}: moe-mesh up {' '.join(setup.up_args)}",
                    file=sys.stderr,
                )
            with setups.started(setup, args.checkpoint, out.parent / "setups") as ready:
                url = _ready_url(ready)
                entry = asyncio.run(_bench_target(url, setup.name, args, report, ready))
            record({**entry, "up_args": list(setup.up_args)})
    else:
        url = args.url or _ready_url(args.ready_file)
        record(asyncio.run(_bench_target(url, args.name, args, report, args.ready_file)))
    print(render(report))
    print(f"wrote {out}", file=sys.stderr)
    try:
        plot.write_png(report, png)
        print(f"wrote {png}", file=sys.stderr)
    except InvalidArgumentError as e:
        print(f"moe-mesh bench: no picture: {e}", file=sys.stderr)
    return 0
