"""Decode throughput of the moe-mesh engine against llama.cpp on the same checkpoint, with the
same threads, back to back in one run: bfloat16 against bfloat16, and our int8 and int4 experts
against llama.cpp's q8_0 and q4_0 ones.

llama.cpp runs in this process through llama-cpp-python's low-level API (an optional extra:
`pip install -e '.[peers]'`, which builds it from source). Without it the bench prints that it
is skipped and why, writes that to its JSON and exits 0.

The checkpoint (`--geometry`, as bench/engine_vs_transformers.py) is converted to GGUF by
bench/gguf_export.py and cached beside it: bfloat16 weights, the routed experts in each
`--experts` type (bf16; q8_0 and q4_0 for the quantized-experts work), norms and router float32.
The engine computes in bfloat16 from the same checkpoint, its experts as each type asks: bf16 in
bfloat16, q8_0 in int8 (`--quantize int8`: per-channel scales, 1 byte a weight against q8_0's
1.06), q4_0 in int4 with groups of 32 (`--quantize int4 --quantize-group-size 32`: 0.5625 bytes a
weight, as q4_0's blocks of 32). Dense weights stay bfloat16 on both sides.

Both sides decode greedily from the same random prompts (engine_vs_transformers' seeds): batch B
is B sequences decoded together (llama.cpp: one llama_batch of B tokens per step, B sequence ids,
its KV cache in float16), and decode tokens/s = B * (new_tokens - 1) / (time to generate
new_tokens - time to generate 1), prefill excluded, on both sides. Each repeat runs the engine,
then llama.cpp in each type; the median of the repeats is kept. llama.cpp gets `--threads`
(default: torch's, which the engine computes with). The engine may still compute a pass of few
tokens on one thread where it measured at start-up that all threads gain too little (its
`--serial-max-tokens`, recorded in each row); `--serial-max-tokens 0` makes it use every thread
for every pass, as llama.cpp does. Before each side
runs, the other's OpenMP workers are ended (runtime.release_openmp_threads): both link the one
libgomp torch loaded.

Each row gives each side's tokens/s, the ratio (engine / llama.cpp), how far the greedy tokens
agree, the weight bytes a token reads (bench.geometry.bytes_per_token; quantized experts at their
block size) and each side's share of the read bandwidth measured in the same run. The JSON also
records the CPU model and its vector flags (AVX2, AVX-512, AVX-512 bf16, AMX) and llama.cpp's
build features.

    .venv/bin/python -m bench.vs_llamacpp [--geometry small] [--batch-sizes 1,8,32]
        [--experts bf16,q8_0,q4_0] [--threads N] [--serial-max-tokens N] [--repeats 3]

(from the checkout root, where `bench` imports as a package)
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from common import runtime

runtime.configure()  # before torch loads OpenMP
import numpy as np  # noqa: E402
import torch  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import host_cpu, parse_settings, write_result  # noqa: E402
from bench.engine_vs_transformers import decode_rate, engine_generate  # noqa: E402
from bench.geometry import GeometrySettings, bytes_per_token, checkpoint_for, expected_experts  # noqa: E402
from common.arch import ModelSpec, checkpoint_spec  # noqa: E402
from common.quant import Quantization  # noqa: E402
from router_service.build import build_local_engine  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402

INSTALL = (
    "pip install -e '.[peers]' (builds llama-cpp-python from source, several minutes; "
    "CMAKE_ARGS='-DGGML_NATIVE=ON' builds it for this CPU's instructions)"
)
# GGUF bytes per expert weight (ggml's blocks of 32: a float16 scale and the codes)
EXPERT_BYTES = {"bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# The engine's experts against each: --quantize and --quantize-group-size
OURS = {"bf16": ("none", 64), "q8_0": ("int8", 64), "q4_0": ("int4", 32)}


class Settings(GeometrySettings):
    out: Path = Field(Path("bench/results/vs_llamacpp.json"), description="the JSON result")
    batch_sizes: str = Field("1,8,32", description="comma-separated batch sizes")
    experts: str = Field(
        "bf16", description="comma-separated GGUF types of llama.cpp's experts: bf16, q8_0, q4_0"
    )
    threads: int = Field(0, ge=0, description="threads of both sides; 0: torch's default")
    serial_max_tokens: int | None = Field(
        None,
        ge=0,
        description="the engine's --serial-max-tokens: passes of up to this many tokens on one "
        "thread; unset: the engine measures it at start-up, as it does when serving; 0: every "
        "pass on every thread, as llama.cpp computes",
    )
    new_tokens: int = Field(32, ge=2, description="tokens generated per sequence")
    prompt_len: int = Field(16, ge=1, description="prompt tokens per sequence")
    repeats: int = Field(3, ge=1, description="runs of each case")


def load_peer():
    """llama_cpp, or None and why not: the package, or its shared library, is missing."""
    runtime.release_openmp_threads()  # finds torch's libgomp while it is the only one loaded
    try:
        import gguf  # noqa: F401  (the conversion)
        import llama_cpp
    except ImportError as e:
        return None, f"{e.name or e} is not installed"
    except (OSError, RuntimeError) as e:  # the package is there, its library does not load
        return None, f"llama_cpp does not load: {e}"
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load log
    return llama_cpp, None


class LlamaCpp:
    """A GGUF model in llama.cpp, decoding batches of sequences greedily (a context per batch
    size, its KV cache holding `tokens_per_seq` per sequence)."""

    def __init__(self, lib, path: Path, threads: int) -> None:
        self.lib, self.threads = lib, threads
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(
            str(path).encode(), lib.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.ctx = self.batch = None

    def open(self, sequences: int, prompt_len: int, tokens_per_seq: int) -> None:
        lib = self.lib
        self.close_context()
        p = lib.llama_context_default_params()
        p.n_seq_max = sequences
        # Split among the sequences (kv_unified is off), each share a multiple of 256 cells.
        p.n_ctx = sequences * -(-tokens_per_seq // 256) * 256
        p.n_batch = p.n_ubatch = max(512, sequences * prompt_len)  # a prefill in one pass
        p.n_threads = p.n_threads_batch = self.threads
        p.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = lib.llama_batch_init(p.n_batch, 0, 1)

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        """Seconds to prefill `prompts` and decode `n` tokens each, and the tokens."""
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        rows = [(s, j, t, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        tokens = self.step(rows).argmax(axis=1).tolist()  # each sequence's first new token
        out = [[t] for t in tokens]
        for k in range(1, n):
            step = [(s, len(prompts[s]) + k - 1, t, True) for s, t in enumerate(tokens)]
            tokens = self.step(step).argmax(axis=1).tolist()
            for seq, t in zip(out, tokens):
                seq.append(t)
        return time.perf_counter() - start, out

    def step(self, rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (sequence, position, token, wants logits) rows: the logits of
        the rows that want them, in row order ([rows wanting logits, vocab], llama.cpp's
        buffer, valid until the next decode)."""
        lib, b = self.lib, self.batch
        for i, (seq, pos, token, wants) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, int(wants)
        b.n_tokens = len(rows)
        if (rc := lib.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for r in rows if r[3])
        return np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), (n_out, self.n_vocab))

    def close_context(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
        if self.ctx:
            self.lib.llama_free(self.ctx)
        self.ctx = self.batch = None

    def close(self) -> None:
        self.close_context()
        self.lib.llama_model_free(self.model)


def llama_generate(peer: LlamaCpp, engines: dict, prompts: list[list[int]], n: int):
    for engine in engines.values():  # the engines' teams, on their compute threads
        engine.model.compute.release_openmp_threads()
    return peer.generate(prompts, n)


def engine_generate_alone(engines: dict, kind: str, prompts: list[list[int]], n: int):
    for other, engine in engines.items():  # idle OpenMP teams spin on the cores
        if other != kind:
            engine.model.compute.release_openmp_threads()
    return engine_generate(engines[kind], prompts, n)


def measure(
    engines: dict, peers: dict[str, LlamaCpp], prompts: dict, args, spec, bandwidth
) -> list:
    """Per batch: warm both sides, then each repeat the engine and llama.cpp in each type."""
    rows = []
    for b, p in prompts.items():
        ours_runs, theirs_runs = {}, {}
        for kind, peer in peers.items():
            peer.open(b, args.prompt_len, args.prompt_len + args.new_tokens)
            ours_runs[kind] = partial(engine_generate_alone, engines, kind)
            theirs_runs[kind] = partial(llama_generate, peer, engines)
        for kind in peers:  # one-time costs (kernel set-up for these shapes) outside the timing
            ours_runs[kind](p, 2)
            theirs_runs[kind](p, 2)
        ours: dict[str, list[float]] = {k: [] for k in peers}
        theirs: dict[str, list[float]] = {k: [] for k in peers}
        same: dict[str, float] = {}
        for _ in range(args.repeats):
            for kind in peers:
                rate, ours_tokens = decode_rate(ours_runs[kind], p, args.new_tokens)
                ours[kind].append(rate)
                rate, tokens = decode_rate(theirs_runs[kind], p, args.new_tokens)
                theirs[kind].append(rate)
                same[kind] = agreement(ours_tokens, tokens)
        for kind in peers:
            serial = engines[kind].model.serial_max_tokens
            figures = (statistics.median(ours[kind]), statistics.median(theirs[kind]), same[kind])
            rows.append(make_row(kind, b, figures, serial, spec, bandwidth))
    for peer in peers.values():
        peer.close_context()
    return rows


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of greedy tokens the two sides agree on before each sequence's first
    difference (bfloat16 on both sides rounds differently, so near-ties may go either way)."""
    agreed = 0
    for a, b in zip(ours, theirs):
        agreed += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return agreed / sum(len(a) for a in ours)


def make_row(kind: str, b: int, figures: tuple, serial: int, spec, bandwidth: float) -> dict:
    ours, theirs, same = figures
    ours_bytes = engine_bytes_per_token(spec, kind, b)
    theirs_bytes = peer_bytes_per_token(spec, kind, b)
    row = {
        "batch": b,
        "llama_cpp_experts": kind,
        "engine_experts": engine_precision(kind),
        "engine_tokens_per_s": ours,
        "llama_cpp_tokens_per_s": theirs,
        "ratio": ours / theirs,
        "greedy_agreement": same,
        "engine_serial_max_tokens": serial,
        "engine_bytes_per_token": ours_bytes,
        "llama_cpp_bytes_per_token": theirs_bytes,
        "engine_bandwidth_share": ours * ours_bytes / bandwidth,
        "llama_cpp_bandwidth_share": theirs * theirs_bytes / bandwidth,
    }
    print(
        f"batch {b:>3}: engine ({engine_precision(kind)}) {ours:7.1f} tok/s   llama.cpp "
        f"(experts {kind}) {theirs:7.1f}"
        f" tok/s   ratio {row['ratio']:.2f}x   greedy agreement {same:.0%}   bandwidth: engine "
        f"{row['engine_bandwidth_share']:.0%} ({ours_bytes / 1e6:.1f} MB/token), llama.cpp "
        f"{row['llama_cpp_bandwidth_share']:.0%} ({theirs_bytes / 1e6:.1f} MB/token)",
        flush=True,
    )
    return row


def peer_bytes_per_token(spec: ModelSpec, kind: str, batch: int) -> int:
    """bytes_per_token in bfloat16 with the experts' share at `kind`'s bytes per weight."""
    experts = expected_experts(spec.num_experts, spec.top_k, batch)
    expert_params = sum(spec.moe_layers) * experts * spec.expert_params / batch
    extra = expert_params * (EXPERT_BYTES[kind] - 2.0)
    return round(bytes_per_token(spec, 2, batch) + extra)


def engine_precision(kind: str) -> str:
    """What the engine's experts are held in against llama.cpp's `kind`."""
    scheme, group = OURS[kind]
    return "bfloat16" if scheme == "none" else Quantization(scheme, group).name


def engine_bytes_per_token(spec: ModelSpec, kind: str, batch: int) -> int:
    """bytes_per_token in bfloat16 with the experts at the engine's quantized size."""
    scheme, group = OURS[kind]
    if scheme == "none":
        return bytes_per_token(spec, 2, batch)
    h, i = spec.hidden_size, spec.expert_intermediate_size
    layout = [Quantization(scheme, group).layout(s) for s in ((2 * i, h), (h, i))]
    held = sum(n * t.itemsize for parts in layout for n, t in parts.values())
    experts = expected_experts(spec.num_experts, spec.top_k, batch)
    expert_params = sum(spec.moe_layers) * experts * spec.expert_params / batch
    return round(
        bytes_per_token(spec, 2, batch) + expert_params * (held / spec.expert_params - 2.0)
    )


def skipped(args, why: str) -> int:
    print(f"vs_llamacpp skipped: {why}. To run it: {INSTALL}", flush=True)
    result = {"benchmark": "vs_llamacpp_decode", "skipped": True, "reason": why}
    write_result(args.out, {**result, "install": INSTALL, "host_cpu": host_cpu()})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_settings(Settings, __doc__, argv)
    kinds = args.experts.split(",")
    if bad := [k for k in kinds if k not in EXPERT_BYTES]:
        raise SystemExit(f"--experts: {bad} not among {list(EXPERT_BYTES)}")
    lib, why = load_peer()
    if lib is None:
        return skipped(args, why)
    if args.threads:
        torch.set_num_threads(args.threads)
    write_result(args.out, run(args, lib, kinds))
    return 0


def run(args, lib, kinds: list[str]) -> dict:
    """Convert (or reuse) the GGUF files, load both sides, measure; the JSON result."""
    from bench.gguf_export import cached_gguf  # after load_peer: it needs `gguf`
    from moe_mesh.planning.measure import read_bandwidth

    threads = torch.get_num_threads()
    checkpoint = checkpoint_for(args.geometry, args.checkpoint)
    spec = checkpoint_spec(checkpoint)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cpu, system_info = host_cpu(), lib.llama_print_system_info().decode().strip()
    print(f"{cpu['cpu']}, {threads} threads; llama.cpp: {system_info}", flush=True)
    paths = {k: cached_gguf(checkpoint, "bf16", k) for k in kinds}
    bandwidth = read_bandwidth(repeats=20)  # best of 20: other processes may be reading too
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(0)  # engine_vs_transformers' prompts
    prompts = {
        b: torch.randint(3, spec.vocab_size, (b, args.prompt_len), generator=gen).tolist()
        for b in batches
    }
    engines = {k: load_engine(checkpoint, max(batches), args.serial_max_tokens, k) for k in kinds}
    peers = {k: LlamaCpp(lib, path, threads) for k, path in paths.items()}
    try:
        rows = measure(engines, peers, prompts, args, spec, bandwidth)
    finally:
        for peer in peers.values():
            peer.close()
        for engine in engines.values():
            engine.close()
    return {
        "benchmark": "vs_llamacpp_decode",
        "geometry": args.geometry,
        "checkpoint": str(checkpoint),
        "gguf": {k: str(p) for k, p in paths.items()},
        "host_cpu": cpu,
        "llama_cpp": {"version": lib.__version__, "system_info": system_info},
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
        "memory_read_bandwidth_bytes_per_s": bandwidth,
        "results": rows,
    }


def load_engine(checkpoint: Path, max_batch: int, serial_max_tokens: int | None, kind: str):
    scheme, group = OURS[kind]
    engine = build_local_engine(
        RouterSettings(
            checkpoint=checkpoint,
            max_num_seqs=max_batch,
            dtype="bfloat16",
            serial_max_tokens=serial_max_tokens,
            quantize=scheme,
            quantize_group_size=group,
        )
    )
    serial = engine.model.serial_max_tokens
    print(f"the engine decodes passes of up to {serial} tokens on one thread", flush=True)
    return engine


if __name__ == "__main__":
    sys.exit(main())
