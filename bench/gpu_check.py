"""The one command a session lent a GPU runs (issue 42): at most ~10 minutes on one H100 or H200
(about 6 on the H200 it ran on), the carried wheels' installation included, writing one JSON and
printing a short table.

    make gpu-wheels   # here: the wheels the GPU machine lacks, into .gpu-wheels/ (carried)
    # there, from the checkout root:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl &&
      PYTHONPATH=/tmp/site:. python3 -m bench.gpu_check --out $OUT

Parts, in order (`--parts a,c` for a subset): a. float32 and bfloat16 parity with transformers on
the GPU, every family (bench/gpu_parity.py); b. `moe-mesh up --device cuda` answering through the
gateway (ditto); c. decode tokens/s of the engine against transformers `generate` on the Mixtral
and Qwen3 slices, with batch 1's share of the measured HBM read bandwidth (bench/gpu_speed.py);
d. the mesh's tokens/s with experts on the GPU over gRPC (and UCX where it travelled), and the
heterogeneous mesh's (ditto); e. the suite's tests that need a CUDA device (bench/gpu_suite.py);
f. the host's own CPU, a kind CPU sessions do not get: batch-1 decode in bfloat16, int8 and int4
on every core, and where a token's time goes (bench/gpu_host_cpu.py).
Each part runs in a process of its own with its own time bound (within `--budget-s` for them
all): one that fails, crashes or runs out of time is recorded, what it measured so far kept, and
the next part runs; a lease is too short to lose to one failure.

`--dry-run` checks the plumbing in seconds, on any host: the wheels folder and every wheel
bench/gpu_wheels.py names, each part's plan and the `up` command lines (parsed by `up`'s own
parser), and torch's CUDA status; it exits 0 without a GPU. `--device cpu` rehearses the parts
themselves on a host without one (slowly: the slices are GBs).

The JSON goes to bench/results/gpu_check.json and, with `--out DIR`, to DIR with the log.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from pydantic import Field

from bench import ScriptSettings, gpu_wheels, parse_settings, write_result
from bench.gpu_support import Context
from common.device import DeviceName

RESULT = Path("bench/results/gpu_check.json")
KILL_GRACE_S = 5.0  # a part's own deadline is this much before its kill
POLL_S = 0.5


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    bound_s: float  # an H200 took a 35, b 20, c 64, d 45, e 23 s; f ~50 on host C (performance.md)
    module: str
    function: str  # run(ctx) -> dict; plan_<function>(ctx) -> dict its dry-run prints


PARTS = {
    p.key: p
    for p in (
        Part("a", "parity with transformers, every family", 100, "bench.gpu_parity", "parity"),
        Part("b", "up --device cuda through the gateway", 60, "bench.gpu_parity", "mesh_answers"),
        Part("c", "decode tok/s: engine vs transformers", 120, "bench.gpu_speed", "decode"),
        Part("d", "mesh tok/s: gRPC, UCX, heterogeneous", 100, "bench.gpu_speed", "mesh_rates"),
        Part("e", "the suite's CUDA tests", 90, "bench.gpu_suite", "suite"),
        Part(
            "f", "the host's CPU: batch-1 decode, every core", 200, "bench.gpu_host_cpu", "host_cpu"
        ),
    )
}


class Settings(ScriptSettings):
    cpu_only = False  # each part says its device

    out: Path | None = Field(None, description="a folder to copy the JSON and log into ($OUT)")
    parts: str = Field("a,b,c,d,e,f", description="comma-separated parts to run, in order")
    dry_run: bool = Field(False, description="check the plumbing only (seconds, no GPU needed)")
    device: DeviceName = Field("cuda", description="where the parts compute (cpu: a rehearsal)")
    work_dir: Path = Field(Path("/tmp/gpu-check"), description="scratch: checkpoints, mesh runs")
    budget_s: float = Field(600.0, gt=0, description="seconds for all the parts together")
    wheels_dir: Path = Field(gpu_wheels.FOLDER, description="the carried wheels (make gpu-wheels)")
    bound_scale: float = Field(
        1.0, gt=0, description="each part's time bound times this (a slower host's rehearsal)"
    )
    slice_layers: int | None = Field(
        None, ge=1, description="layers of part c's slices (default: bench/geometry.py's)"
    )
    part_json: Path | None = Field(
        None, description="internal: run the one part of --parts here, its result to this file"
    )


def selected(args: Settings) -> list[Part]:
    keys = [k.strip() for k in args.parts.split(",") if k.strip()]
    if unknown := [k for k in keys if k not in PARTS]:
        raise SystemExit(
            f"--parts: unknown part(s) {', '.join(unknown)}; parts are {', '.join(PARTS)}"
        )
    return [PARTS[k] for k in keys]


def cuda_status() -> dict:
    import torch

    status = {"torch": torch.__version__, "cuda_build": torch.version.cuda}
    status["cuda_available"] = torch.cuda.is_available()
    if status["cuda_available"]:
        status["device_name"] = torch.cuda.get_device_name(0)
        status["device_memory_gib"] = round(
            torch.cuda.get_device_properties(0).total_memory / 2**30, 1
        )
    return status


def wheels_status(folder: Path) -> dict:
    """The wheels folder and the names bench/gpu_wheels.py lists that it lacks."""
    status: dict = {"folder": str(folder), "present": folder.is_dir()}
    status["missing"] = gpu_wheels.missing(folder) if folder.is_dir() else list(gpu_wheels.WHEELS)
    status["ucx"] = not gpu_wheels.missing(folder, gpu_wheels.UCX)
    if not folder.is_dir():
        status["how"] = "run `make gpu-wheels` on a host with PyPI, and carry .gpu-wheels"
    return status


def up_problems(flags: list[str]) -> list[str]:
    """What `moe-mesh up` (and the router, for --router-arg) would refuse in `flags`."""
    from common.cli import settings_from_args
    from common.errors import InvalidArgumentError
    from moe_mesh.cli import build_parser
    from moe_mesh.local.settings import UpSettings
    from router_service import cli as router_cli

    router = argparse.ArgumentParser(add_help=False)
    router_cli.add_arguments(router)
    problems = []
    for who, parser, argv in (
        ("up", build_parser("up"), ["up", "--checkpoint", "X", *flags]),
        ("the router", router, ["--checkpoint", "X", *(f.split("=", 1)[1] for f in flags if f.startswith("--router-arg="))]),
    ):  # fmt: skip
        try:
            parsed, unknown = parser.parse_known_args(argv)
            if who == "up":  # its values are checked by its settings model, after parsing
                settings_from_args(UpSettings, parsed)
        except SystemExit:  # a value refused: the parser said which on stderr
            problems.append(f"{who} refuses a value in {shlex.join(flags)} (its message above)")
            continue
        except InvalidArgumentError as e:
            problems.append(f"{who}: {e}")
        problems += [f"{who} does not take {u}" for u in unknown if u.startswith("-")]
    return problems


def dry_run(args: Settings, parts: list[Part]) -> dict:
    """Every part's plan and the plumbing, nothing run: the report the check would start from."""
    ctx = Context(args.device, args.work_dir, time.monotonic(), None, args.slice_layers)
    report: dict = {"cuda": cuda_status(), "wheels": wheels_status(args.wheels_dir), "parts": {}}
    for part in parts:
        plan = getattr(import_module(part.module), "plan_" + part.function)(ctx)
        flags = plan.get("up_flags", [])
        plan["commands"] = [child_command(args, part)] + [
            ["moe-mesh", "up", "--checkpoint", "CHECKPOINT", *f] for f in flags
        ]
        plan["problems"] = [p for f in flags for p in up_problems(f)]
        report["parts"][part.key] = {"title": part.title, "bound_s": part.bound_s, **plan}
    return report


def child_command(args: Settings, part: Part) -> list[str]:
    cmd = [sys.executable, "-m", "bench.gpu_check", "--parts", part.key, "--device", args.device]
    cmd += [
        "--work-dir",
        str(args.work_dir),
        "--part-json",
        str(args.work_dir / f"part-{part.key}.json"),
    ]
    if args.slice_layers is not None:
        cmd += ["--slice-layers", str(args.slice_layers)]
    return cmd


def run_child(args: Settings, part: Part) -> None:
    """In the part's own process: run it, its result (or its error) in --part-json."""
    deadline = time.monotonic() + bound_left(args)
    ctx = Context(args.device, args.work_dir, deadline, args.part_json, args.slice_layers)
    try:
        getattr(import_module(part.module), part.function)(ctx)
        ctx.record("status", "ok" if ctx.result.get("ok", True) else "failed")
    except Exception as e:
        traceback.print_exc()
        ctx.record("status", "failed")
        ctx.record("error", f"{type(e).__name__}: {e}"[:1500])


def bound_left(args: Settings) -> float:
    """A child's seconds: its parent passes the bound in the environment."""
    return float(os.environ.get("MOE_GPU_CHECK_BOUND_S", "60"))


def descendants(root: int) -> dict[int, str]:
    """pid -> start time (/proc/PID/stat's 22nd field) of every process below `root` now; none
    where there is no /proc."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        starts[int(entry.name)] = fields[19]
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = starts[child]
            todo.append(child)
    return out


def kill_left(seen: dict[int, str]) -> None:
    """SIGKILL those of `seen` still running (the same process: same pid and start time)."""
    for pid, started in seen.items():
        now = start_time(pid)
        if now == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def run_part(args: Settings, part: Part, bound_s: float, log) -> dict:
    """The part in a process of its own, killed (its whole group) past `bound_s`; its result."""
    out = args.work_dir / f"part-{part.key}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "MOE_GPU_CHECK_BOUND_S": str(bound_s - KILL_GRACE_S)}
    start = time.monotonic()
    proc = subprocess.Popen(
        child_command(args, part), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=env, start_new_session=True,
    )  # fmt: skip
    seen: dict[int, str] = {}  # every descendant met, with its start time (meshes run as
    # sessions of their own, out of the part's group, and outlive a part killed or crashed)
    while proc.poll() is None and time.monotonic() - start < bound_s:
        seen.update(descendants(proc.pid))
        time.sleep(POLL_S)
    status = None
    if proc.poll() is None:
        status = f"timed out after {bound_s:.0f} s"
        seen.update(descendants(proc.pid))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kill_left(seen)
    result = json.loads(out.read_text()) if out.exists() else {}
    if status is None and "status" not in result:
        status = f"crashed (exit {proc.returncode})"
    if status is not None:
        result["status"] = status
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def plumbing(report: dict) -> str:
    """The dry run's report as text: torch's CUDA status, the wheels, each part's plan."""
    wheels = report["wheels"]
    lines = [f"torch: {report['cuda']}"]
    if not wheels["present"]:
        lines.append(f"wheels: no folder {wheels['folder']}: {wheels['how']}")
    else:
        lines.append(f"wheels: {wheels['folder']}, missing: {', '.join(wheels['missing']) or 'none'}"
                     f"; UCX: {'there' if wheels['ucx'] else 'left out (the mesh runs over gRPC)'}")  # fmt: skip
    for key, plan in report["parts"].items():
        rest = {
            k: v for k, v in plan.items() if k not in ("title", "commands", "problems", "up_flags")
        }
        lines.append(f"part {key}: {plan['title']} (at most {plan['bound_s']:.0f} s) {rest}")
        lines += [f"    $ {shlex.join(c)}" for c in plan["commands"]]
        lines += [f"    problem: {p}" for p in plan["problems"]]
    return "\n".join(lines)


def table(results: dict) -> str:
    lines = [f"{'part':<4} {'status':<22} {'s':>6}  summary"]
    for key, r in results.items():
        lines.append(
            f"{key:<4} {r.get('status', '?'):<22} {r.get('seconds', 0):>6}  {r.get('summary', r.get('error', ''))}"
        )
    return "\n".join(lines)


def check(args: Settings, parts: list[Part]) -> dict:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    report = {"cuda": cuda_status(), "wheels": wheels_status(args.wheels_dir), "parts": {}}
    print(f"{report['cuda']}\nwheels missing: {report['wheels']['missing'] or 'none'}", flush=True)
    deadline = time.monotonic() + args.budget_s
    with open(args.work_dir / "gpu_check.log", "a") as log:
        for part in parts:
            left = deadline - time.monotonic()
            if left < 20:
                report["parts"][part.key] = {"status": "skipped: budget spent"}
                continue
            bound = min(part.bound_s * args.bound_scale, left)
            print(f"part {part.key}: {part.title} (at most {bound:.0f} s)", flush=True)
            result = run_part(args, part, bound, log)
            report["parts"][part.key] = result
            save(args, RESULT, report)  # a lease cut short keeps what is done
            print(
                f"part {part.key}: {result['status']} in {result['seconds']} s: {result.get('summary', '')}",
                flush=True,
            )
    return report


def save(args: Settings, path: Path, report: dict) -> None:
    """The report at `path`, and with the log in --out when given."""
    write_result(path, report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.out / path.name)
        if (log := args.work_dir / "gpu_check.log").exists():
            shutil.copy(log, args.out / "gpu_check.log")


def main(argv: list[str] | None = None) -> int:
    args = parse_settings(Settings, __doc__, argv, skip=("checkpoint",))
    parts = selected(args)
    if args.part_json is not None:
        run_child(args, parts[0])
        return 0
    start = time.monotonic()
    report = dry_run(args, parts) if args.dry_run else check(args, parts)
    report.update(
        benchmark="gpu_check", dry_run=args.dry_run, seconds=round(time.monotonic() - start, 1)
    )
    if args.dry_run:
        print(plumbing(report))
    save(args, RESULT.with_name("gpu_check_dry_run.json") if args.dry_run else RESULT, report)
    if not args.dry_run:
        print(table(report["parts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
