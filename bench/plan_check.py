"""Does `moe-mesh plan --search` predict what the plan it picks then does? End to end, in one run,
with the real commands (each a subprocess of `python -m moe_mesh`):

1. `moe-mesh profile` on the checkpoint (KV context = input + output / 2, the mean of the decode);
2. a utilization record: `moe-mesh up` (default mesh), a little traffic with `moe-mesh bench`,
   `moe-mesh status --json` and `moe-mesh placement show --json`, the mesh stopped;
3. `moe-mesh plan --search` over the profile and the record with this machine's inventory
   (`deploy/inventory.example.yaml`) and `deploy/plan.example.yaml` as the base (its model id and
   sizes set to the checkpoint's, one router: what the search predicts for), with the benchmark's
   `--input-len` / `--output-len` (each step then carries B·input/output prompt tokens),
   calibrated on the traffic's bench and status (moe_mesh/planning/calibrate.py);
4. the chosen plan run for real with `moe-mesh up`: its expert groups (contiguous index groups when
   they are the plan's, else `moe-mesh scale` to the plan's exact groups and the default ones
   removed), replicas, B as `--max-num-seqs`, m as `--micro-batches`, the router's flags (threads,
   `--fast-path off` when gRPC was predicted), colocation budget;
5. `moe-mesh bench` against it at concurrency B, decode-dominated requests (default 64 in, 128
   out): measured decode tokens/s = B / TPOT p50, against the predicted tokens/s. While it runs,
   `moe-mesh status --json` is sampled for the router's own Ta / Te / Tc per MoE layer.

Writes bench/results/plan_check.json: predicted, measured, ratio, within_20_percent, the plan, the
`up` flags (and what could not be expressed exactly), the model's per-layer breakdown next to the
router's fitted costs, every command and file.

    .venv/bin/python -m bench.plan_check [--checkpoint DIR] [--input-len 64] [--output-len 128]

(from the checkout root, where `bench` imports as a package; bench/plan_check_model.py holds the
plan-side arithmetic)
"""

from __future__ import annotations

import json
import resource
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import yaml
from pydantic import Field

from bench import DEFAULT_CHECKPOINT, ScriptSettings, ensure_checkpoint, parse_settings
from bench.plan_check_model import base_plan, breakdown, cpu_by_role, frozenset_spec, translate
from common.errors import MoeMeshError
from common.placement import ModelShape
from moe_mesh.local.processes import RunningMesh, running_up

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "moe_mesh"]


class Settings(ScriptSettings):
    checkpoint: Path = Field(
        ROOT / DEFAULT_CHECKPOINT, description="checkpoint; created if missing"
    )
    out: Path = Field(ROOT / "bench/results/plan_check.json", description="the JSON report")
    workdir: Path | None = Field(None, description="default .cache/plan-check-<time>")
    input_len: int = Field(64, ge=1, description="prompt tokens per request")
    output_len: int = Field(128, ge=1, description="output tokens per request")
    tpot_slo_ms: float = Field(2000.0, gt=0, description="generous: any plan")
    max_num_seqs: int | None = Field(None, ge=1, description="largest B searched (default 32)")
    inventory: Path = Field(ROOT / "deploy/inventory.example.yaml", description="machines")
    base: Path = Field(ROOT / "deploy/plan.example.yaml", description="the base plan")
    profile_repeats: int = Field(20, ge=1, description="`moe-mesh profile --repeats`")
    profile_sizes: str = Field("1,2,4,8,16,32,64", description="`moe-mesh profile --sizes`")
    traffic_requests: int = Field(8, ge=1, description="requests of the utilization record")
    waves: int = Field(3, ge=1, description="requests measured = waves x B")
    status_every_s: float = Field(5.0, gt=0, description="`moe-mesh status` sampled this often")
    reuse: bool = Field(
        False, description="reuse the profile and utilization record already in --workdir"
    )
    timeout_s: float = Field(900.0, gt=0, description="bound of each command")


def say(text: str) -> None:
    print(f"plan_check: {text}", flush=True)


class Runner:
    """Runs `moe-mesh` subcommands, each bounded in time, and remembers every command."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.commands: list[dict] = []

    def run(self, name: str, argv: list[str], timeout_s: float, stdout: Path | None = None) -> str:
        """Run `moe-mesh argv`; stdout to `stdout` (else returned), stderr to <name>.log."""
        cmd = [*CLI, *argv]
        log = self.workdir / f"{name}.log"
        entry = {"name": name, "command": shlex.join(cmd), "log": str(log)}
        if stdout is not None:
            entry["stdout"] = str(stdout)
        self.commands.append(entry)
        say(f"{name}: {shlex.join(argv)}")
        start = time.monotonic()
        with open(log, "w") as err:
            out = open(stdout, "w") if stdout is not None else subprocess.PIPE
            try:
                proc = subprocess.run(
                    cmd, stdout=out, stderr=err, text=True, timeout=timeout_s, cwd=ROOT
                )
            except subprocess.TimeoutExpired:
                entry.update(exit_code=None, seconds=round(time.monotonic() - start, 1))
                raise SystemExit(
                    f"{name} did not finish within {timeout_s:g}s; log {log}"
                ) from None
            finally:
                if stdout is not None:
                    out.close()
        entry.update(exit_code=proc.returncode, seconds=round(time.monotonic() - start, 1))
        if proc.returncode != 0:
            raise SystemExit(f"{name} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        return proc.stdout if stdout is None else ""

    @contextmanager
    def mesh(self, name: str, checkpoint: Path, flags: list[str], ready_timeout_s: float):
        """`moe-mesh up FLAGS` (moe_mesh/local/processes.py), remembered like the commands."""
        ready, log = self.workdir / f"{name}.ready.json", self.workdir / f"{name}.log"
        run_dir = self.workdir / f"{name}-run"
        argv = [
            "up",
            "--checkpoint",
            str(checkpoint),
            *flags,
            "--ready-file",
            str(ready),
            "--run-dir",
            str(run_dir),
        ]
        self.commands.append({"name": name, "command": shlex.join([*CLI, *argv]), "log": str(log)})
        say(f"{name}: {shlex.join(argv)}")
        with running_up(
            checkpoint, flags, ready_file=ready, run_dir=run_dir, log_path=log,
            ready_timeout_s=ready_timeout_s, stop_timeout_s=60,
        ) as mesh:  # fmt: skip
            yield mesh
        say(f"{name} stopped (exit {mesh.proc.returncode})")


def status(ready_file: Path) -> dict:
    out = subprocess.run(
        [*CLI, "status", "--ready-file", str(ready_file), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return json.loads(out.stdout) if out.stdout.strip() else {}


def wait_placement(ready_file: Path, shape, want: list, timeout_s: float) -> dict:
    """Until the router dispatches to exactly the plan's groups and replica counts."""
    from collections import Counter

    from common.placement import parse_experts

    want_count = Counter(dict(want))
    deadline = time.monotonic() + timeout_s
    while True:
        st = status(ready_file)
        placement = st.get("routers", [{}])[0].get("placement", {}) if st else {}
        have = Counter(
            frozenset_spec(frozenset(parse_experts(s, shape))) for s in placement.values()
        )
        if have == want_count:
            return st
        if time.monotonic() > deadline:
            raise SystemExit(f"the router's placement {dict(have)} is not the plan's {want}")
        time.sleep(1.0)


def sample_status(ready_file: Path, proc: subprocess.Popen, every_s: float):
    """`moe-mesh status --json` every `every_s` while `proc` runs: the router's pipeline figures."""
    samples = []
    start = time.monotonic()
    while proc.poll() is None:
        time.sleep(every_s)
        if proc.poll() is not None:
            break
        try:
            st = status(ready_file)
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            continue
        for r in st.get("routers", []):
            samples.append(
                {
                    "t_s": round(time.monotonic() - start, 1),
                    "running": r.get("running"),
                    "steps": r.get("steps"),
                    "micro_batches": r.get("micro_batches"),
                    "transports": sorted({x["transport"] for x in r.get("replicas", [])}),
                }
            )
    return samples


def main() -> int:
    args = parse_settings(Settings, __doc__)
    ensure_checkpoint(args.checkpoint)
    ckpt = args.checkpoint.resolve()
    workdir = args.workdir or ROOT / f".cache/plan-check-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(workdir)
    names = ("profile", "traffic_bench", "window", "traffic_status", "base_plan", "plan")
    suffix = {"base_plan": "base.yaml", "plan": "plan.yaml", "traffic_bench": "traffic.json"}
    files = {"workdir": str(workdir)}
    for name in (*names, "prediction", "bench"):
        files[name] = str(workdir / suffix.get(name, name.replace("_", "-") + ".json"))
    try:
        profile = run_profile(args, runner, ckpt, files)
        record_utilization(args, runner, ckpt, files)
        base_changes = search(args, runner, files, profile)
        prediction = json.loads(Path(files["prediction"]).read_text())
        plan = yaml.safe_load(Path(files["plan"]).read_text())
        shape = ModelShape(
            profile["num_layers"], profile["num_experts"], tuple(profile["moe_layers"])
        )
        up = translate(plan, prediction, shape, profile["cores"])
        model = breakdown(Path(files["profile"]), Path(files["window"]), prediction, shape)
        say(
            f"plan: B={prediction['batch_size']} m={prediction['micro_batches']} "
            f"{prediction['transport']} {len(plan['expert_groups'])} group(s); predicted "
            f"{prediction['predicted_tokens_per_s']:.1f} tokens/s, TPOT "
            f"{prediction['predicted_tpot_ms']:.2f} ms ({prediction['bound']})"
        )
        run = run_plan(args, runner, ckpt, up, shape, prediction, files)
    except MoeMeshError as e:  # a mesh that did not come up: its log's tail is in the message
        raise SystemExit(str(e)) from None
    point = json.loads(Path(files["bench"]).read_text())["setups"][0]["points"][0]
    run["cpu"] = cpu_report(run, model, prediction, profile, point, args.output_len)
    result = report(args, ckpt, profile, prediction, plan, point, run)
    result.update(base_plan_changes=base_changes, up=up, model_breakdown=model)
    result.update(cpu_during_bench=run["cpu"], router_status=run["router_status"])
    result.update(files=files, commands=runner.commands)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    m, ratio = result["measured"], result["ratio_measured_over_predicted"]
    factor = (prediction.get("calibration") or {}).get("factor", 1.0)
    say(
        f"predicted {prediction['predicted_tokens_per_s']:.1f} tokens/s (TPOT "
        f"{prediction['predicted_tpot_ms']:.1f} ms), measured {m['decode_tokens_per_s']:.1f} "
        f"tokens/s (B={prediction['batch_size']} / TPOT p50 {m['tpot_p50_ms']:.1f} ms; output "
        f"{point['output_throughput']:.1f} tokens/s): ratio {ratio:.2f}, within 20%: "
        f"{result['within_20_percent']} (the model uncalibrated: ratio {ratio / factor:.2f}; "
        f"calibration factor {factor:.3f})"
    )
    print(f"wrote {args.out}")
    return 0


def run_profile(args: Settings, runner: Runner, ckpt: Path, files: dict) -> dict:
    """1. `moe-mesh profile` at the mean KV length over a request's decode."""
    if args.reuse and Path(files["profile"]).exists():
        say(f"profile: reusing {files['profile']}")
    else:
        context = args.input_len + args.output_len // 2
        argv = ["profile", "--checkpoint", str(ckpt), "--out", files["profile"]]
        argv += ["--context", str(context), "--sizes", args.profile_sizes]
        runner.run("profile", [*argv, "--repeats", str(args.profile_repeats)], args.timeout_s)
    return json.loads(Path(files["profile"]).read_text())


def record_utilization(args: Settings, runner: Runner, ckpt: Path, files: dict) -> None:
    """2. A little traffic through the default mesh, then its status and placement window."""
    if args.reuse and Path(files["window"]).exists():
        say(f"utilization record: reusing {files['window']}")
        return
    with runner.mesh("up-utilization", ckpt, [], args.timeout_s) as mesh:
        ready = str(mesh.ready_file)
        traffic = ["bench", "--ready-file", ready, "--concurrency", "4"]
        traffic += ["--num-requests", str(args.traffic_requests), *_lengths(args)]
        traffic += ["--quiet", "--out", files["traffic_bench"]]
        out = runner.workdir / "traffic.out"
        runner.run("traffic", traffic, args.timeout_s, stdout=out)
        status_argv = ["status", "--ready-file", ready, "--json"]
        runner.run("traffic-status", status_argv, 120, stdout=Path(files["traffic_status"]))
        show = ["placement", "show", "--ready-file", ready, "--json"]
        runner.run("placement-show", show, 120, stdout=Path(files["window"]))


def _lengths(args: Settings) -> list[str]:
    return ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]


def search(args: Settings, runner: Runner, files: dict, profile: dict) -> dict:
    """3. `moe-mesh plan --search`, calibrated on the traffic; returns the base plan's changes."""
    base_changes = base_plan(args.base, profile, Path(files["base_plan"]))
    argv = ["plan", "--search", "--profile", files["profile"], "--utilization", files["window"]]
    argv += ["--inventory", str(args.inventory), "--base", files["base_plan"]]
    argv += ["--tpot-slo-ms", f"{args.tpot_slo_ms:g}", "--out", files["plan"]]
    argv += ["--prediction-out", files["prediction"], *_lengths(args)]
    argv += ["--calibrate-bench", files["traffic_bench"]]
    argv += ["--calibrate-status", files["traffic_status"]]
    if args.max_num_seqs:
        argv += ["--max-num-seqs", str(args.max_num_seqs)]
    runner.run("plan-search", argv, args.timeout_s)
    print((runner.workdir / "plan-search.log").read_text(), end="", flush=True)
    return base_changes


def run_plan(args, runner: Runner, ckpt: Path, up: dict, shape, prediction: dict, files) -> dict:
    """4-5. The plan run for real, measured with `moe-mesh bench` at concurrency B."""
    b = prediction["batch_size"]
    with runner.mesh("up-plan", ckpt, up["up_flags"], 600) as mesh:
        ready = str(mesh.ready_file)
        for s in up["scale"]:
            argv = ["scale", "--ready-file", ready, "--experts", s["experts"]]
            runner.run(
                f"scale-{len(runner.commands)}", [*argv, "--replicas", str(s["replicas"])], 300
            )
        before = wait_placement(mesh.ready_file, shape, up["expected_placement"], 60)
        measure = ["bench", "--ready-file", ready, "--concurrency", str(b)]
        measure += ["--num-requests", str(args.waves * b), *_lengths(args)]
        measure += [
            "--max-duration-s",
            str(int(args.timeout_s)),
            "--quiet",
            "--out",
            files["bench"],
        ]
        run = measure_bench(args, runner, mesh, measure)
        after = status(mesh.ready_file)
    router_after = after.get("routers", [{}])[0]
    run["steps"] = router_after.get("steps", 0) - before.get("routers", [{}])[0].get("steps", 0)
    run["router_status"] = {
        "before_bench": before.get("routers", [{}])[0].get("micro_batches"),
        "after_bench": router_after.get("micro_batches"),
        "placement": router_after.get("placement"),
        "transports": sorted({x["transport"] for x in router_after.get("replicas", [])}),
        "samples_during_bench": run.pop("samples"),
    }
    return run


def measure_bench(args: Settings, runner: Runner, mesh: RunningMesh, measure: list[str]) -> dict:
    """`moe-mesh bench` while `moe-mesh status` is sampled; every process's CPU seconds around it."""
    cmd = [*CLI, *measure]
    log = runner.workdir / "bench.log"
    runner.commands.append({"name": "bench", "command": shlex.join(cmd), "log": str(log)})
    say(f"bench: {shlex.join(measure)}")
    cpu_before = cpu_by_role(mesh.ready_file, mesh.proc.pid)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            samples = sample_status(mesh.ready_file, proc, args.status_every_s)
            proc.wait(max(1.0, args.timeout_s + 60 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SystemExit("bench did not finish in time") from None
    runner.commands[-1].update(
        exit_code=proc.returncode, seconds=round(time.monotonic() - start, 1)
    )
    print(log.read_text(), end="", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench exited {proc.returncode}; log {log}")
    cpu_after = cpu_by_role(mesh.ready_file, mesh.proc.pid)
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
    cpu["bench client + status polls"] = sum(
        getattr(children_after, f) - getattr(children_before, f) for f in ("ru_utime", "ru_stime")
    )
    return {"cpu": cpu, "wall_s": runner.commands[-1]["seconds"], "samples": samples}


def cpu_report(
    run: dict, model: dict, prediction: dict, profile: dict, point: dict, n: int
) -> dict:
    """CPU seconds by role over the bench, per engine step and per output token, next to the model's."""
    wall, steps, b = run["wall_s"], run["steps"], prediction["batch_size"]
    roles: dict[str, float] = {}
    for name, secs in run["cpu"].items():
        role = name.split("-")[0] if name.startswith(("expert-", "router-")) else name
        roles[role] = roles.get(role, 0.0) + secs
    report = {
        "window_s": wall,
        "engine_steps": steps,
        "wall_ms_per_step": wall / steps * 1e3 if steps else None,
        "cpu_s": {k: round(v, 2) for k, v in sorted(roles.items())},
        "cpu_ms_per_step": {k: round(v / steps * 1e3, 2) for k, v in sorted(roles.items())}
        if steps
        else None,
        "cores_busy": round(sum(roles.values()) / wall, 2),
        "note": "steps include the prefill steps and the warm-up request; the bench client "
        "shares the cores",
    }
    one_node = len(prediction["plan"]["nodes"]) == 1
    modelled = model["router_cpu_ms_per_step"] + model["experts_cpu_ms_per_step"]
    if steps:
        # Next to the model's CPU per step; the harness (gateway, launcher, bench client) is not
        # modelled: what the prediction would be if its CPU shared the one node, for the report.
        per_step = report["cpu_ms_per_step"]
        harness = sum(
            per_step.get(k, 0.0)
            for k in ("gateway", "launcher (registry)", "bench client + status polls")
        )
        report["model_vs_measured_cpu_ms_per_step"] = {
            "router": [model["router_cpu_ms_per_step"], per_step.get("router")],
            "expert": [model["experts_cpu_ms_per_step"], per_step.get("expert")],
        }
        report["harness_cpu_ms_per_step"] = round(harness, 2)
        if one_node:
            report["predicted_tpot_with_harness_cpu_ms"] = round(
                max(prediction["predicted_tpot_ms"], (modelled + harness) / profile["cores"]), 2
            )
    # The gateway belongs to a deployment (the bench client does not): its CPU per output token,
    # measured here and not modelled; what a step of B tokens would cost with it on the node.
    out_tokens = point["completed"] * n  # the warm-up request's aside
    if out_tokens:
        per_token = {
            k: round(roles.get(k, 0.0) / out_tokens * 1e3, 3)
            for k in ("gateway", "bench client + status polls")
        }
        report["cpu_ms_per_output_token"] = per_token
        if steps and one_node:
            with_gateway = modelled + per_token["gateway"] * b
            report["predicted_tpot_with_gateway_cpu_ms"] = round(
                max(prediction["predicted_tpot_ms"], with_gateway / profile["cores"]), 2
            )
    return report


def report(args: Settings, ckpt: Path, profile, prediction, plan, point, run) -> dict:
    """The prediction next to the measurement, and the plan that was run."""
    b = prediction["batch_size"]
    measured = b / (point["tpot_ms"]["p50"] / 1e3)
    ratio = measured / prediction["predicted_tokens_per_s"]
    factor = (prediction.get("calibration") or {}).get("factor", 1.0)
    context = args.input_len + args.output_len // 2
    return {
        "checkpoint": str(ckpt),
        "model_id": profile["model_id"],
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "profile_context": context,
        },
        "predicted": {
            "decode_tokens_per_s": prediction["predicted_tokens_per_s"],
            "tpot_ms": prediction["predicted_tpot_ms"],
            "pipeline_tpot_ms": prediction["pipeline_tpot_ms"],
            "bound": prediction["bound"],
            "calibration": prediction.get("calibration"),
        },
        "ratio_measured_over_uncalibrated_model": ratio / factor,
        "measured": {
            "decode_tokens_per_s": measured,
            "tpot_p50_ms": point["tpot_ms"]["p50"],
            **{k: point[k] for k in ("tpot_ms", "itl_ms", "ttft_ms")},
            "output_tokens_per_s": point["output_throughput"],
            **{k: point[k] for k in ("completed", "failed", "duration_s")},
        },
        "ratio_measured_over_predicted": ratio,
        "within_20_percent": abs(ratio - 1.0) <= 0.2,
        "plan": {
            "batch_size": b,
            "micro_batches": prediction["micro_batches"],
            "transport": prediction["transport"],
            "expert_groups": prediction["plan"]["expert_groups"],
            "nodes": prediction["plan"]["nodes"],
            "router": plan.get("router", {}),
        },
    }


if __name__ == "__main__":
    sys.exit(main())
