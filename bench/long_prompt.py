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

import random
import tempfile
import time
from pathlib import Path

import httpx
from pydantic import Field

from bench import ScriptSettings, parse_settings, write_result
from moe_mesh.benchmark.metrics import samples, total
from moe_mesh.local.processes import RunningMesh, running_up

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


class Settings(ScriptSettings):
    checkpoint: Path = Field(CHECKPOINT, description="the wide checkpoint; created if missing")
    out: Path = Field(Path("bench/results/long_prompt.json"), description="the JSON result")
    prompt_len: int = Field(2048, ge=1, description="tokens of the long prompt")
    replicas: int = Field(1, ge=1, description="replicas of the expert service")
    warmups: int = Field(6, ge=0, description="short requests before it")


def counters(mesh: RunningMesh) -> dict[str, float]:
    scraped = [samples(address) for address in mesh.info["metrics"]["routers"]]
    return {name: sum(total(s, name) for s in scraped) for name in COUNTERS}


def run_case(args: Settings, workdir: Path, name: str, flags: str) -> dict:
    router = f"--max-model-len {args.prompt_len + 64} {flags}"
    slug = name.replace(" ", "-")
    up_flags = ("--expert-services", "1", "--replicas", str(args.replicas), "--router-arg", router)
    rng = random.Random(0)
    with running_up(
        args.checkpoint, up_flags, ready_file=workdir / f"{slug}.json", run_dir=workdir / slug,
        log_path=workdir / f"{slug}.log", ready_timeout_s=180,
    ) as mesh:  # fmt: skip
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
    args = parse_settings(Settings, __doc__)
    if not (args.checkpoint / "config.json").exists():
        from moe_mesh.dev.create_checkpoint import create_checkpoint

        create_checkpoint(
            args.checkpoint, "mixtral", "small", seed=0, overrides=WIDE, progress=True
        )
    with tempfile.TemporaryDirectory(prefix="long-prompt-") as tmp:
        cases = {name: run_case(args, Path(tmp), name, flags) for name, flags in CASES.items()}
    write_result(args.out, {"prompt_len": args.prompt_len, "replicas": args.replicas, **cases})


if __name__ == "__main__":
    main()
