"""Parts c and d of bench/gpu_check.py: decode rates on a GPU.

c. Decode tokens/s of the engine (RouterSettings(device=..., dtype="bfloat16")) against
   transformers `generate` in bfloat16 on the same GPU, at batch 1, 32 and 128, on the
   Mixtral-8x7B and Qwen3-30B-A3B slices of bench/geometry.py (their real layer shapes; 2 and 4
   layers, or `--slice-layers`). The slices are created in the check's scratch folder: they are
   GBs, and the lease carries 64 MiB. They are initialised on the GPU where transformers allows it
   (seconds), else on the CPU (measured here, AMD EPYC 2 shared cores: 17 s for a 0.46 G-parameter
   one-layer slice, so ~110 s for the Mixtral slice's 3.0 G), and the seconds are recorded. Decode
   tokens/s = batch * (n - 1) / (time for n tokens - time for 1), as in
   bench/engine_vs_transformers.py. The device's read bandwidth is measured in the same run (the
   best of several sums of a 4 GiB bfloat16 tensor), and batch 1's share of it is tokens/s times
   the weight bytes a token reads (bench.geometry.bytes_per_token).
d. The mesh's tokens/s through the gateway (`--concurrency` greedy completions at once, and one
   alone) on the Mixtral slice where part c left it (else the `small` preset): experts on the GPU
   over gRPC (`up --device cuda --router-arg=--fast-path=off`), over UCX where ucxx imports, and the
   heterogeneous mesh (`up --device cuda --expert-device cpu`: router on the GPU, expert services
   on the CPU).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from bench.gpu_support import Context, complete, free_device_memory, load_hf

SLICES = ("mixtral-8x7b-slice", "qwen3-30b-a3b-slice")
BATCHES = (1, 32, 128)
NEW_TOKENS = 32
PROMPT_LEN = 16
REPEATS = 2
MESH_NEW_TOKENS = 32
CONCURRENCY = 32


def read_bandwidth(device: str, gib: int = 4, repeats: int = 10) -> float:
    """Bytes/s `device` reads: the best of `repeats` sums of a `gib` GiB tensor (random, not
    zeros), timed with the device synchronised."""
    import torch

    # float32 on a CPU, whose bfloat16 sum is bound by widening, not by memory (a rehearsal's)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    x = torch.randn((gib << 30) // dtype.itemsize, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        sync(device)
        start = time.perf_counter()
        x.sum(dtype=torch.float32)
        sync(device)
        best = min(best, time.perf_counter() - start)
    n = x.numel() * x.element_size()
    del x
    free_device_memory()
    return n / best


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def make_slice(ctx: Context, name: str, layers: int | None) -> tuple[Path, float, str]:
    """The slice's checkpoint under the scratch folder (path, seconds to create it, where its
    weights were initialised): on the device first, then on the CPU if that raised."""
    import dataclasses
    import shutil

    import torch

    from bench.geometry import GEOMETRIES, create

    g = GEOMETRIES[name]
    if layers is not None:
        g = dataclasses.replace(g, overrides={**g.overrides, "num_hidden_layers": layers})
    path = ctx.work / f"{name}-{g.overrides['num_hidden_layers']}L"
    if (path / "config.json").exists():
        return path, 0.0, "cached"
    start = time.monotonic()
    for where in dict.fromkeys((ctx.device, "cpu")):
        shutil.rmtree(path, ignore_errors=True)
        try:
            with torch.device(where):
                create(g, path)
            return path, time.monotonic() - start, where
        except Exception as e:  # on to the CPU
            ctx.log(f"creating {name} on {where} failed ({type(e).__name__}: {e}); on the CPU")
    raise RuntimeError(f"could not create {name}")


def engine_run(engine, prompts: list[list[int]], k: int) -> tuple[float, list[list[int]]]:
    """Seconds for the engine to generate k greedy tokens for every prompt, and the tokens."""
    from bench.gpu_support import engine_greedy

    start = time.perf_counter()
    tokens, _ = engine_greedy(engine, prompts, k)  # ends with the tokens on the host
    return time.perf_counter() - start, tokens


def hf_run(model, prompts: list[list[int]], k: int) -> tuple[float, list[list[int]]]:
    """Seconds for transformers `generate` to give k greedy tokens per prompt, and the tokens."""
    import torch

    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        tokens = out[:, ids.shape[1] :].tolist()  # synchronises
    return time.perf_counter() - start, tokens


def side_rates(ctx: Context, run, prompts: dict[int, list[list[int]]]) -> dict[int, tuple]:
    """{batch: (decode tokens/s, tokens)} of one side, after a warm-up per batch: batch *
    (NEW_TOKENS - 1) over the fastest of REPEATS runs of NEW_TOKENS less the fastest of 1 token
    (None where noise leaves no difference); batches the time bound leaves no room for are left
    out."""
    out = {}
    for b, p in prompts.items():
        if ctx.left_s() < 10:
            break
        run(p, 2)  # one-time costs for these shapes
        first = min(run(p, 1)[0] for _ in range(REPEATS))
        runs = [run(p, NEW_TOKENS) for _ in range(REPEATS)]
        decode_s = min(s for s, _ in runs) - first
        out[b] = (b * (NEW_TOKENS - 1) / decode_s if decode_s > 0 else None, runs[-1][1])
    return out


def ratio_row(rate: float | None, hf_rate: float | None, share_of: float) -> dict:
    """One batch's figures; `share_of`: the bytes/s one token per second reads over bandwidth."""
    row = {"engine_tokens_per_s": rate, "transformers_tokens_per_s": hf_rate}
    if rate and hf_rate:
        row.update(ratio=round(rate / hf_rate, 2), bandwidth_share=round(rate * share_of, 3))
        row.update(engine_tokens_per_s=round(rate, 1), transformers_tokens_per_s=round(hf_rate, 1))
    return row


def decode_slice(ctx: Context, name: str, bandwidth: float, layers: int | None) -> dict:
    import torch

    from bench.geometry import bytes_per_token
    from bench.gpu_parity import build_engine
    from common.arch import checkpoint_spec

    path, seconds, where = make_slice(ctx, name, layers)
    spec = checkpoint_spec(path)
    row: dict = {"created_s": round(seconds, 1), "created_on": where, "layers": spec.num_layers}
    ctx.log(f"{name}: created in {seconds:.0f} s on {where}")
    gen = torch.Generator().manual_seed(0)
    prompts = {
        b: torch.randint(3, spec.vocab_size, (b, PROMPT_LEN), generator=gen).tolist()
        for b in BATCHES
    }
    engine = build_engine(path, ctx.device, "bfloat16", max_num_seqs=max(BATCHES))
    try:
        ours = side_rates(ctx, partial(engine_run, engine), prompts)
    finally:
        engine.close()
    free_device_memory()
    hf = load_hf(path, "bfloat16", ctx.device)
    theirs = side_rates(ctx, partial(hf_run, hf), {b: prompts[b] for b in ours})
    del hf
    free_device_memory()
    for b in theirs:
        (rate, a), (hf_rate, h) = ours[b], theirs[b]
        row[f"batch_{b}"] = ratio_row(rate, hf_rate, bytes_per_token(spec, 2, b) / bandwidth)
        row[f"batch_{b}"]["greedy_identical"] = a == h
    return row


def decode(ctx: Context) -> dict:
    """Part c: every slice; one that raises is recorded and the next runs."""
    bandwidth = read_bandwidth(ctx.device)
    ctx.record("read_bandwidth_bytes_per_s", bandwidth)
    ctx.log(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
    for name in SLICES:
        try:
            ctx.record(name, decode_slice(ctx, name, bandwidth, ctx.slice_layers))
        except Exception as e:
            ctx.record(name, {"error": f"{type(e).__name__}: {e}"[:600]})
    heads = []
    for name in SLICES:
        row = ctx.result[name]
        for b in BATCHES:
            if f"batch_{b}" in row:
                heads.append(f"{name.split('-')[0]} b{b} {row[f'batch_{b}'].get('ratio')}x")
    mix = ctx.result[SLICES[0]].get("batch_1", {})
    if "bandwidth_share" in mix:
        heads.append(f"mixtral b1 {mix['bandwidth_share']:.0%} of HBM")
    ctx.record("summary", ", ".join(heads) or "no rate measured")
    return ctx.result


def mesh_setups(device: str, ucx: bool) -> dict[str, list[str]]:
    """Name -> `up` flags of each mesh part d measures."""
    base = ["--expert-services", "2", "--device", device]
    setups = {f"all on {device}, gRPC": [*base, "--router-arg=--fast-path=off"]}
    if ucx:
        setups[f"all on {device}, UCX"] = [*base, "--router-arg=--fast-path=ucx"]
    setups[f"router on {device}, experts on cpu"] = [*base, "--expert-device", "cpu"]
    return setups


def ucx_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ucxx") is not None


def mesh_checkpoint(ctx: Context) -> Path:
    """Part c's Mixtral slice where it is there, else the `small` preset (created here)."""
    made = sorted(ctx.work.glob(f"{SLICES[0]}-*L/config.json"))
    if made:
        return made[0].parent
    from bench.geometry import checkpoint_for

    return checkpoint_for("small", ctx.work / "small-mixtral")


def mesh_rate(mesh_info: dict, prompts: list[list[int]], concurrency: int) -> float:
    """Completion tokens/s of `prompts` sent `concurrency` at a time through the gateway."""
    import httpx

    with httpx.Client(base_url=f"http://{mesh_info['gateway_http']}/v1", timeout=120) as h:
        complete(h, prompts[0], 2)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(lambda p: complete(h, p, MESH_NEW_TOKENS), prompts))
        return sum(map(len, outs)) / (time.perf_counter() - start)


def mesh_rates(ctx: Context) -> dict:
    """Part d: each set-up of mesh_setups, its tokens/s at one request and at CONCURRENCY."""
    import random

    from moe_mesh.local.processes import running_up

    path = mesh_checkpoint(ctx)
    ctx.record("checkpoint", path.name)
    ctx.record("ucx", ucx_available())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(PROMPT_LEN)] for _ in range(CONCURRENCY)]
    for i, (name, flags) in enumerate(mesh_setups(ctx.device, ucx_available()).items()):
        run = ctx.work / f"mesh-d{i}"
        try:
            with running_up(
                path, flags, ready_file=run / "ready.json", run_dir=run, log_path=run / "up.log",
                ready_timeout_s=max(ctx.left_s() - 30, 10),
            ) as mesh:  # fmt: skip
                row = {
                    "up_flags": flags,
                    "batch_1_tokens_per_s": round(mesh_rate(mesh.info, prompts[:1], 1), 1),
                }
                row[f"concurrency_{CONCURRENCY}_tokens_per_s"] = round(
                    mesh_rate(mesh.info, prompts, CONCURRENCY), 1
                )
        except Exception as e:
            row = {"up_flags": flags, "error": f"{type(e).__name__}: {e}"[:600]}
        ctx.record(name, row)
    rates = [
        f"{n}: {r.get(f'concurrency_{CONCURRENCY}_tokens_per_s', 'failed')}"
        for n, r in ctx.result.items()
        if isinstance(r, dict)
    ]
    ctx.record("summary", f"tok/s at {CONCURRENCY} concurrent: " + "; ".join(rates))
    return ctx.result


def plan_decode(ctx: Context) -> dict:
    return {"slices": list(SLICES), "batches": list(BATCHES), "new_tokens": NEW_TOKENS}


def plan_mesh_rates(ctx: Context) -> dict:
    return {
        "up_flags": list(mesh_setups(ctx.device, ucx_available()).values()),
        "ucx": ucx_available(),
    }
