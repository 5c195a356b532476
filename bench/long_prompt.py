"""A long prompt after short requests, through `moe-mesh up`, on experts as wide as a 7B-class
model's: its prefill's expert calls are many times larger than the decode calls the router learned
its timeouts, hedge delays and fast-path budget from, and may be larger than a message.

The checkpoint is Mixtral `small` with four experts 8,192 wide in two layers (~850 MB, created at
.cache/bench-wide-mixtral if missing). Each case starts its own mesh (one expert service with
`--replicas` replicas), sends `--warmups` short requests, then the long prompt (2 new tokens), and
reports its HTTP status and seconds and what the routers counted meanwhile: hedges, ejections,
failovers and fast-path fallbacks. Cases: the defaults (512-token prefill chunks); 2,048-token
chunks; and a router message limit of 1 MiB (a chunk's rows are 4 MiB).

    .venv/bin/python -m bench.long_prompt [--prompt-len 2048] [--replicas 1] [--warmups 6]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import httpx

from bench import write_result
from bench.chaos import Mesh
from tests.support.metrics import scrape, total

CHECKPOINT = Path(".cache/bench-wide-mixtral")
WIDE = {"intermediate_size": 8192, "num_hidden_layers": 2, "num_local_experts": 4}
CASES = {
    "defaults": "",
    "2048-token chunks": "--max-prefill-tokens 2048",
    "1 MiB messages": "--max-message-bytes 1048576",
}
COUNTERS = (
    "moe_router_hedges_total",
    "moe_router_ejections_total",
    "moe_router_failovers_total",
    "moe_router_fast_path_fallbacks_total",
)


def counters(mesh: Mesh) -> dict[str, float]:
    samples = [scrape(address) for address in mesh.info["metrics"]["routers"]]
    return {name: sum(total(s, name) for s in samples) for name in COUNTERS}


def run_case(args: argparse.Namespace, workdir: Path, name: str, flags: str) -> dict:
    router = f"--max-model-len {args.prompt_len + 64} {flags}"
    slug = name.replace(" ", "-")
    mesh = Mesh(
        CHECKPOINT, workdir, slug, "--expert-services", "1",
        "--replicas", str(args.replicas), "--router-arg", router,
    )  # fmt: skip
    rng = random.Random(0)
    try:
        with httpx.Client(base_url=f"http://{mesh.info['gateway_http']}/v1", timeout=600) as h:
            model = h.get("/models").json()["data"][0]["id"]

            def complete(length: int, max_tokens: int) -> tuple[httpx.Response, float]:
                prompt = [rng.randrange(3, 8000) for _ in range(length)]
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
                began = time.monotonic()
                reply = h.post("/completions", json={**body, "temperature": 0})
                return reply, time.monotonic() - began

            for _ in range(args.warmups):
                complete(8, 8)
            before = counters(mesh)
            reply, seconds = complete(args.prompt_len, 2)
            after = counters(mesh)
    finally:
        mesh.stop()
    result = {
        "router_flags": router,
        "status": reply.status_code,
        "seconds": round(seconds, 2),
        **{name: after[name] - before[name] for name in COUNTERS},
    }
    if reply.status_code != 200:
        result["error"] = reply.json().get("error", {}).get("message", reply.text)[:300]
    print(f"{name}: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--warmups", type=int, default=6, help="short requests before it")
    parser.add_argument("--out", type=Path, default=Path("bench/results/long_prompt.json"))
    args = parser.parse_args()
    if not (CHECKPOINT / "config.json").exists():
        from moe_mesh.dev.create_checkpoint import create_checkpoint

        create_checkpoint(CHECKPOINT, "mixtral", "small", seed=0, overrides=WIDE, progress=True)
    with tempfile.TemporaryDirectory(prefix="long-prompt-") as tmp:
        cases = {name: run_case(args, Path(tmp), name, flags) for name, flags in CASES.items()}
    write_result(args.out, {"prompt_len": args.prompt_len, "replicas": args.replicas, **cases})


if __name__ == "__main__":
    main()
