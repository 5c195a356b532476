"""Benchmarks, run from the checkout root as `python -m bench.<name>` (`make bench` runs them all).
They use the product's own tooling (moe_mesh/local/processes.py, moe_mesh/benchmark/), never the
tests'. Each declares its flags once, as a `ScriptSettings` model; JSON goes to bench/results/."""

import argparse
import os
import sys
import typing
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.cli import add_settings_arguments, flag, settings_from_args
from common.errors import InvalidArgumentError

DEFAULT_CHECKPOINT = Path(".cache/bench-small-mixtral")
CPU_ONLY = (  # the device settings of the router, expert services, `up` and `generate --local`
    "MOE_ROUTER_DEVICE",
    "MOE_EXPERT_DEVICE",
    "MOE_MESH_UP_DEVICE",
    "MOE_MESH_UP_EXPERT_DEVICE",
    "MOE_MESH_GENERATE_DEVICE",
)
S = typing.TypeVar("S", bound="ScriptSettings")


class ScriptSettings(BaseSettings):
    """What every benchmark takes: its checkpoint and where its JSON goes. A bench subclasses it,
    setting `out`'s default and adding its own fields; each field is a flag (common/cli.py)."""

    model_config = SettingsConfigDict(env_prefix="MOE_BENCH_", extra="forbid")
    # The benches measure CPUs. On a GPU host `auto` put quantized engines on the CPU and the
    # bfloat16 one on the GPU, and compared the two (bench/quantized.py on the H200's host).
    # gpu_check's parts name their devices themselves.
    cpu_only: typing.ClassVar[bool] = True

    checkpoint: Path = Field(
        DEFAULT_CHECKPOINT,
        description="checkpoint to use; the default is created (small Mixtral) if missing",
    )
    out: Path = Field(Path("bench/results/bench.json"), description="the JSON result goes here")


def parse_settings(
    model: type[S], doc: str | None, argv: list[str] | None = None, skip: tuple[str, ...] = ()
) -> S:
    """`model` from the command line: one flag per field but `skip`'s, list fields taking several
    values (`--sizes 1 2 4`); a bad value exits with status 2 and one line naming the flag."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    lists = [n for n, f in model.model_fields.items() if typing.get_origin(f.annotation) is list]
    add_settings_arguments(parser, model, skip=[*lists, *skip])
    for name in lists:
        field = model.model_fields[name]
        parser.add_argument(
            flag(name), dest=name, nargs="+", default=None,
            help=f"{field.description} (default {' '.join(map(str, field.default))})",
        )  # fmt: skip
    if model.cpu_only:  # read here and by every child process
        os.environ.update(dict.fromkeys(CPU_ONLY, "cpu"))
    try:
        return typing.cast(S, settings_from_args(model, parser.parse_args(argv)))
    except InvalidArgumentError as e:
        parser.error(str(e))
        sys.exit(2)  # parser.error exits; this line is for type checkers


def ensure_checkpoint(path: Path) -> None:
    """Create the `small` Mixtral at `path` (seed 0, with progress) unless a checkpoint is there."""
    # Here, not at the top: each bench configures OpenMP before torch loads.
    from bench.geometry import checkpoint_for

    checkpoint_for("small", path)


# The CPU flags that say which kernels a host runs: what every figure is quoted with.
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni")
FLAGS += ("amx_tile", "amx_bf16", "amx_int8")


def host_cpu() -> dict:
    """The CPU model, core count and which of FLAGS it has, from /proc/cpuinfo."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in FLAGS}}


def write_result(path, result: dict) -> None:
    """`result` plus the run's torch version, threads, machine, CPU (`host_cpu`) and
    MOE_MESH_MAX_ISA (where set), as JSON at `path`."""
    import json
    import platform

    import torch  # here, not at the top: each bench configures OpenMP before torch loads

    path.parent.mkdir(parents=True, exist_ok=True)
    run = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if isa := os.environ.get("MOE_MESH_MAX_ISA"):  # as set: the kernels ran no higher
        run["max_isa"] = isa
    run["host_cpu"] = result.get("host_cpu") or host_cpu()
    path.write_text(json.dumps({**result, **run, "machine": platform.machine()}, indent=2))
    print(f"wrote {path}")
