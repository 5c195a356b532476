"""Tiered placement on a skewed `small` checkpoint, all in one run against the same expert services:

- all-remote: every expert on expert services (gRPC);
- tiered: the router colocates the hottest experts up to a budget of 25% of all expert bytes,
  chosen by its policy from the utilization window after a warm-up;
- all-colocated: the monolithic engine.

For each: decode tokens/s, expert-service calls per generated token, and the share of routed
(token, expert) assignments computed in the router. Rounds alternate the three so drift in this
machine's speed hits them alike; medians and ratios to all-remote go to bench/results/tiering.json.

    .venv/bin/python -m bench.tiering [--checkpoint DIR] [--skew 4] [--batches 1,16] [--rounds 3]

(from the checkout root, where `bench` imports as a package)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pydantic import (
    Field,  # noqa: E402
    field_validator,  # noqa: E402
)

from bench import ScriptSettings, parse_settings  # noqa: E402
from common import runtime

runtime.configure(shares_cores=True)  # a mesh on this host: before torch loads OpenMP
import torch  # noqa: E402
import uvloop  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

from bench.host import around  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from moe_mesh.dev.create_checkpoint import create_checkpoint  # noqa: E402
from moe_mesh.local.processes import start_experts  # noqa: E402
from router_service.build import build_local_engine, build_router  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402


async def decode(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Generate `new_tokens` per prompt; tokens/s of the decode steps and the dispatcher's counters moved."""
    d = engine.model.dispatcher
    calls0, local0, routed0 = d.remote_calls, d.tokens_colocated, sum(map(sum, d.routed_counts()))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    await engine.step()  # prefill (and the first token) is not decode
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished():
        for o in await engine.step():
            if o.error is not None:
                raise o.error
            generated += len(o.new_token_ids)
    elapsed = time.perf_counter() - start
    total = len(prompts) * new_tokens
    return {
        "tokens_per_s": generated / elapsed,
        "remote_calls_per_token": (d.remote_calls - calls0) / total,
        "in_process_share": (d.tokens_colocated - local0)
        / max(1, sum(map(sum, d.routed_counts())) - routed0),
    }


async def rounds(engines: dict, tiered, prompts, args: ScriptSettings) -> dict:
    """Each batch size's rounds, the three set-ups in turn on the same prompts."""
    runs: dict[int, dict[str, list[dict]]] = {
        b: {name: [] for name in engines} for b in args.batches
    }
    for b in args.batches:
        for r in range(args.rounds):
            batch = prompts(b)  # the same prompts for all three in a round
            for name, engine in engines.items():
                runs[b][name].append(await decode(engine, batch, args.new_tokens))
                m = runs[b][name][-1]
                print(
                    f"batch {b:>2} round {r + 1} {name:<14} {m['tokens_per_s']:7.1f} tok/s  "
                    f"{m['remote_calls_per_token']:6.2f} remote calls/token  "
                    f"{m['in_process_share']:6.1%} in-process",
                    flush=True,
                )
            await tiered.tierer.step()  # live policy between rounds, as the background loop would
    return runs


def summarize(runs: dict) -> dict:
    """Medians per batch size and set-up, and each set-up's throughput over all-remote's."""
    summary = {}
    for b, by_name in runs.items():
        summary[b] = {
            name: {k: statistics.median(m[k] for m in ms) for k in ms[0]}
            for name, ms in by_name.items()
        }
        for s in summary[b].values():
            s["throughput_vs_all_remote"] = (
                s["tokens_per_s"] / summary[b]["all_remote"]["tokens_per_s"]
            )
    return summary


async def main_async(args: ScriptSettings) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="moe-bench-tiering-"))
    specs = ["*:0-1", "*:2-3", "*:4-5", "*:6-7"]
    experts = start_experts(args.checkpoint, specs, workdir, "--compute-threads", "1")
    endpoints = [e.address for e in experts]
    try:
        remote = await build_router(
            RouterSettings(checkpoint=args.checkpoint, expert_endpoints=endpoints)
        )
        tiered = await build_router(
            RouterSettings(
                checkpoint=args.checkpoint,
                expert_endpoints=endpoints,
                colocate_budget="25%",
                tier_min_dwell_s=0,
            )
        )
        engines = {
            "all_remote": remote.engine,
            "tiered_25pct": tiered.engine,
            "all_colocated": build_local_engine(RouterSettings(checkpoint=args.checkpoint)),
        }
        vocab = remote.engine.model.spec.vocab_size
        gen = torch.Generator().manual_seed(0)

        def prompts(n: int) -> list[list[int]]:
            return torch.randint(3, vocab, (n, 16), generator=gen).tolist()

        print(
            "==> warm-up: every engine once; the tiered router then re-tiers from its window",
            flush=True,
        )
        for engine in engines.values():
            await decode(engine, prompts(16), 8)
        await tiered.tierer.step()
        t = tiered.tierer
        print(
            f"    colocated {len(t.hot)} experts, {t.colocated_bytes() / 2**20:.0f} of "
            f"{t.config.budget_bytes / 2**20:.0f} MiB budget",
            flush=True,
        )

        runs = await rounds(engines, tiered, prompts, args)
        summary = summarize(runs)
        for parts in (remote, tiered):
            for b in parts.remotes:
                await b.close()
        return {
            "checkpoint": str(args.checkpoint),
            "batches": args.batches,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "budget_bytes": t.config.budget_bytes,
            "colocated_experts": len(t.hot),
            "promotions": t.promotions,
            "demotions": t.demotions,
            "summary": summary,
            "runs": runs,
        }
    finally:
        for e in experts:
            e.stop()


class Settings(ScriptSettings):
    checkpoint: Path | None = Field(
        None,
        description="a skewed checkpoint (default: .cache/bench-small-mixtral-skew{S}, created if missing)",
    )
    out: Path = Field(ROOT / "bench/results/tiering.json", description="the JSON result")
    skew: float = Field(4.0, description="router skew of the created checkpoint")
    batches: list[int] = Field(
        [1, 16], description="numbers of concurrent sequences (1,16 or 1 16)"
    )
    new_tokens: int = Field(24, ge=1, description="tokens generated per sequence")
    rounds: int = Field(3, ge=1, description="alternating rounds of the three set-ups")

    @field_validator("batches", mode="before")
    @classmethod
    def _commas(cls, v):
        return [x for t in v for x in str(t).split(",")] if isinstance(v, list) else v


def main() -> int:
    args = parse_settings(Settings, __doc__)
    if args.checkpoint is None:
        args.checkpoint = ROOT / f".cache/bench-small-mixtral-skew{args.skew:g}"
        if not (args.checkpoint / "config.json").exists():
            print(
                f"==> creating {args.checkpoint} (small preset, router skew {args.skew:g})",
                flush=True,
            )
            create_checkpoint(
                args.checkpoint, "mixtral", "small", router_skew=args.skew, progress=True
            )
    result = around(lambda: uvloop.run(main_async(args)))  # the router's loop (mesh_dispatch.run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for b, by_name in result["summary"].items():
        for name, s in by_name.items():
            print(
                f"batch {b:>2} {name:<14} {s['tokens_per_s']:7.1f} tok/s ({s['throughput_vs_all_remote']:.2f}x "
                f"all-remote)  {s['remote_calls_per_token']:6.2f} remote calls/token  "
                f"{s['in_process_share']:6.1%} in-process"
            )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
