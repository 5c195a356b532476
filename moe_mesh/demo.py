"""`make demo`: create a checkpoint if none is given, generate a few requests, show what happened.

At this stage the demo runs the monolithic engine (every expert in-process); later issues turn it
into the full mesh with remote expert services.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

PROMPTS = [
    ("The expert services", 0.0),
    ("Mixture-of-Experts models route each token to", 0.0),
    ("Once upon a time", 0.8),
    ("In a distributed system, the router", 0.8),
]


def _heatmap(counts: torch.Tensor) -> str:
    """Layers × experts table of routed token counts, with each layer's hottest expert marked."""
    lines = ["layer " + "".join(f"{f'e{e}':>7}" for e in range(counts.shape[1]))]
    for layer, row in enumerate(counts.tolist()):
        hot = max(range(len(row)), key=row.__getitem__)
        lines.append(f"{layer:>5} " + "".join(f"{v:>6}{'*' if e == hot else ' '}" for e, v in enumerate(row)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="an existing checkpoint directory")
    src.add_argument("--create", type=Path, help="where to create (or reuse) the demo's small Mixtral checkpoint")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from common.tokenizer import Tokenizer
    from moe_mesh.create_checkpoint import create_checkpoint
    from moe_mesh.local import LocalRequest, generate_local
    from router_service.build import build_local_engine
    from router_service.sampling import SamplingParams
    from router_service.settings import RouterSettings

    path = args.checkpoint or args.create
    if args.create and not (path / "config.json").exists():
        print(f"==> creating a small Mixtral checkpoint with skewed routing in {path}", file=sys.stderr)
        create_checkpoint(path, "mixtral", "small", seed=0, router_skew=2.0, progress=True)
    print(f"==> loading {path} (monolithic engine: all experts in this process)")
    t0 = time.perf_counter()
    engine = build_local_engine(RouterSettings(checkpoint=path))
    tokenizer = Tokenizer(path)
    spec = engine.model.spec
    print(f"    {spec.family}: {spec.num_layers} layers, {spec.num_experts} experts top-{spec.top_k}, "
          f"hidden {spec.hidden_size}, vocab {spec.vocab_size}; loaded in {time.perf_counter() - t0:.1f}s")

    requests = [LocalRequest(f"req-{i}", tokenizer.encode(text),
                             SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=i, ignore_eos=True))
                for i, (text, temp) in enumerate(PROMPTS)]
    print(f"==> generating {len(requests)} requests in one continuous batch (streaming req-0)\n")
    print(f"[req-0] {PROMPTS[0][0]}", end="", flush=True)

    def stream(rid: str, delta: str) -> None:
        if rid == "req-0":
            print(delta, end="", flush=True)

    start = time.perf_counter()
    results = asyncio.run(generate_local(engine, tokenizer, requests, stream))
    wall = time.perf_counter() - start
    print("\n")
    for (prompt, temp), r in zip(PROMPTS, results):
        j = r.to_json()
        print(f"[{r.request_id}] temp={temp} {prompt!r} -> {r.text[:60]!r}...")
        print(f"         {j['usage']['completion_tokens']} tokens, finish={r.finish_reason}, "
              f"latency {r.latency_s:.2f}s, first token {r.time_to_first_token_s * 1000:.0f} ms, "
              f"{j['decode_tokens_per_s']} tok/s")
    total = sum(len(r.token_ids) for r in results)
    print(f"\n==> {total} tokens in {wall:.2f}s: {total / wall:.1f} tokens/s aggregate")
    print("==> tokens routed per (layer, expert) (* = hottest expert of the layer):")
    print(_heatmap(engine.model.dispatcher.tokens_routed))
    print("\n(The checkpoint is random-initialised, so the text is gibberish; the routing and timings are real.)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
