"""A long prompt arriving while sequences decode, with and without chunked prefill (local engine,
every expert colocated, `small` preset Mixtral by default, float32).

16 sequences decode; then a 2,000-token prompt arrives. Measured per run: its time to first token
(arrival to the step that samples its first token) and the decoding sequences' worst inter-token
gap from its arrival to that token, against their median gap before it arrived. Runs alternate
the two set-ups; medians over the repeats. Every long prompt is new random tokens and prefix
caching is off, so nothing is found cached.

    .venv/bin/python -m bench.chunked_prefill [--checkpoint DIR] [--prompt-len 2000] [--decoders 16]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

from common import runtime

runtime.configure()  # before torch loads OpenMP
import torch  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, ensure_checkpoint, parse_settings, write_result  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from router_service.build import build_local_engine  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402


async def one_run(engine, args, gen: torch.Generator, run: int) -> dict:
    """Decoders warm up, the long prompt arrives, measure until its first token (+2 steps)."""
    vocab = engine.model.spec.vocab_size
    # Long enough to outlast the measurement: they are aborted at its end.
    greedy = SamplingParams(
        engine.model.max_model_len - args.decoder_prompt_len, 0.0, ignore_eos=True
    )
    decoders = [f"d{run}-{i}" for i in range(args.decoders)]
    for rid in decoders:
        prompt = torch.randint(3, vocab, (args.decoder_prompt_len,), generator=gen).tolist()
        engine.add_request(rid, prompt, greedy)
    arrivals: dict[str, list[float]] = {rid: [] for rid in decoders}
    long_id, added, first = f"long{run}", None, None
    steps = 0
    while first is None or steps < 2:
        outputs = await engine.step()
        now = time.perf_counter()  # one time per step: its tokens stream out together
        for o in outputs:
            if o.request_id in arrivals and o.new_token_ids:
                arrivals[o.request_id].append(now)
            if o.request_id == long_id and o.new_token_ids:
                first = now
        if added is None and min(len(a) for a in arrivals.values()) >= args.warmup_tokens:
            prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
            engine.add_request(long_id, prompt, SamplingParams(1, 0.0, ignore_eos=True))
            added = time.perf_counter()
        steps += first is not None
    for rid in decoders:
        engine.abort(rid)
    while engine.has_unfinished():
        await engine.step()
    gaps = [(a, b) for ts in arrivals.values() for a, b in zip(ts, ts[1:])]
    return {
        "ttft_s": first - added,
        # gaps ending while the long prompt was being computed, up to its first token
        "worst_gap_s": max(b - a for a, b in gaps if added < b <= first),
        "median_gap_before_s": statistics.median(b - a for a, b in gaps if b <= added),
    }


def settings(args, chunked: bool) -> RouterSettings:
    return RouterSettings(
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        max_num_seqs=args.decoders + 1,
        max_prefill_tokens=args.max_prefill_tokens,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=False,
        kv_cache_bytes=args.kv_cache_bytes,
        micro_batches="1",
    )


class Settings(ScriptSettings):
    out: Path = Field(Path("bench/results/chunked_prefill.json"), description="the JSON result")
    dtype: str = Field("float32", description="compute dtype")
    prompt_len: int = Field(2000, ge=1, description="tokens of the long prompt")
    decoders: int = Field(16, ge=1, description="sequences decoding when it arrives")
    decoder_prompt_len: int = Field(32, ge=1, description="their prompts' tokens")
    warmup_tokens: int = Field(6, ge=0, description="decode tokens before")
    max_prefill_tokens: int = Field(512, ge=1, description="the router's prefill chunk")
    kv_cache_bytes: str = Field("1GiB", description="KV-cache bytes")
    repeats: int = Field(3, ge=1, description="runs of each set-up")


def main() -> int:
    args = parse_settings(Settings, __doc__)

    ensure_checkpoint(args.checkpoint)
    engines = {
        "chunked": build_local_engine(settings(args, True)),
        "whole": build_local_engine(settings(args, False)),
    }
    gen = torch.Generator().manual_seed(0)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.repeats):
        for name, engine in engines.items():
            runs[name].append(asyncio.run(one_run(engine, args, gen, r)))
            print(
                f"run {r} {name:>8}: "
                + "  ".join(f"{k} {v:.3f}" for k, v in runs[name][-1].items()),
                flush=True,
            )
    rows = {}
    for name, results in runs.items():
        rows[name] = {k: statistics.median(x[k] for x in results) for k in results[0]}
        row = rows[name]
        label = (
            f"{name} (max {args.max_prefill_tokens} prompt tokens a step)"
            if name == "chunked"
            else "whole prompt in one step"
        )
        print(
            f"{label:<40} TTFT {row['ttft_s']:6.2f} s   decoders' worst gap "
            f"{row['worst_gap_s']:6.3f} s (median gap before {row['median_gap_before_s']:.3f} s)"
        )
    spec = engines["chunked"].model.spec
    write_result(
        args.out,
        {
            "benchmark": "chunked_prefill",
            "checkpoint": str(args.checkpoint),
            "model": {
                "family": spec.family,
                "layers": spec.num_layers,
                "hidden": spec.hidden_size,
            },
            "dtype": args.dtype,
            "prompt_len": args.prompt_len,
            "decoders": args.decoders,
            "max_prefill_tokens": args.max_prefill_tokens,
            "repeats": args.repeats,
            "results": rows,
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
