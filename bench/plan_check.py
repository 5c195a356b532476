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

(from the checkout root, where `bench` imports as a package)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = ROOT / ".cache/bench-small-mixtral"
CLI = [sys.executable, "-m", "moe_mesh"]


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


class Mesh:
    """`moe-mesh up` in a session of its own, stopped with SIGTERM to its pid (SIGKILL to the
    session it started after a bound)."""

    def __init__(self, runner: Runner, name: str, argv: list[str], ready_timeout_s: float) -> None:
        self.runner, self.name = runner, name
        self.ready_file = runner.workdir / f"{name}.ready.json"
        self.ready_file.unlink(missing_ok=True)
        self.log = runner.workdir / f"{name}.log"
        argv = [*argv, "--ready-file", str(self.ready_file)]
        argv += ["--run-dir", str(runner.workdir / f"{name}-run")]
        cmd = [*CLI, *argv]
        runner.commands.append({"name": name, "command": shlex.join(cmd), "log": str(self.log)})
        say(f"{name}: {shlex.join(argv)}")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
        deadline = time.monotonic() + ready_timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} did not come up:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(0.2)  # the launcher writes the ready file atomically; let it settle

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the session it started
                self.proc.wait(10)
        say(f"{self.name} stopped (exit {self.proc.returncode})")


def base_plan(example: Path, profile: dict, out: Path) -> dict:
    """The example plan with the checkpoint's model id and sizes and one router (what the search
    predicts for). Returns what was changed."""
    raw = yaml.safe_load(example.read_text())
    changed = {
        "model.model_id": [raw["model"].get("model_id"), profile["model_id"]],
        "model.num_layers": [raw["model"].get("num_layers"), profile["num_layers"]],
        "model.num_experts": [raw["model"].get("num_experts"), profile["num_experts"]],
        "router.replicas": [raw["router"].get("replicas", 1), 1],
    }
    raw["model"].update(
        model_id=profile["model_id"],
        num_layers=profile["num_layers"],
        num_experts=profile["num_experts"],
    )
    raw["router"]["replicas"] = 1
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return {k: v for k, v in changed.items() if v[0] != v[1]}


def translate(plan: dict, prediction: dict, shape, cores: int) -> dict:
    """The plan as `moe-mesh up` flags, plus the `moe-mesh scale` calls that give the plan's exact
    groups when they are not up's contiguous index groups, and what is approximated."""
    from common.placement import parse_experts
    from moe_mesh.local.launcher import expert_groups

    router = plan.get("router", {})
    groups = plan["expert_groups"]
    replicas = [g.get("replicas", 1) for g in groups]
    uniform = len(set(replicas)) == 1
    r = replicas[0] if uniform else 1
    routers = router.get("replicas", 1)
    args = list(router.get("args", []))
    if prediction["transport"] == "grpc" and "--fast-path" not in " ".join(args):
        args += ["--fast-path", "off"]
    flags = [
        "--expert-services",
        str(len(groups)),
        "--replicas",
        str(r),
        "--routers",
        str(routers),
        "--max-num-seqs",
        str(router.get("max_num_seqs", prediction["batch_size"])),
        "--colocate-budget",
        str(router.get("colocate_budget", "0")),
        f"--router-arg=--micro-batches {router.get('micro_batches', prediction['micro_batches'])}",
    ]
    if args:
        flags.append(f"--router-arg={shlex.join(args)}")
    wanted = [frozenset(parse_experts(g["experts"], shape)) for g in groups]
    default = expert_groups(shape.num_experts, len(groups))
    default_sets = [frozenset(parse_experts(s, shape)) for s in default]
    scale = []
    if not uniform or set(wanted) != set(default_sets):
        scale += [(g["experts"], n) for g, n in zip(groups, replicas)]
        scale += [(s, 0) for s, p in zip(default, default_sets) if p not in wanted]
    approximations = []
    up_threads = max(1, cores // (len(groups) * r + routers))
    planned_threads = sorted({g.get("compute_threads") for g in groups} - {None})
    if planned_threads and planned_threads != [up_threads]:
        approximations.append(
            f"expert services run on {up_threads} torch thread(s) each (`moe-mesh up` gives "
            f"cores // processes and has no flag for it); the plan says {planned_threads}"
        )
    if not uniform:
        approximations.append(
            f"replicas differ per group {replicas}: started with --replicas 1, then `moe-mesh "
            "scale` set each group's count (their threads follow the first count)"
        )
    return {
        "up_flags": flags,
        "scale": [{"experts": s, "replicas": n} for s, n in scale],
        "default_groups": default,
        "exact_groups": not scale,
        "approximations": approximations,
        "expected_placement": sorted(
            (frozenset_spec(w), n) for w, n in zip(wanted, replicas) if n > 0
        ),
    }


def frozenset_spec(pairs: frozenset) -> str:
    from common.placement import format_experts

    return format_experts(sorted(pairs))


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """utime + stime of each live process, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_by_role(ready_file: Path, launcher_pid: int):
    pids = json.loads(ready_file.read_text())["pids"]
    pids["launcher (registry)"] = launcher_pid
    return cpu_seconds(pids)


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


def breakdown(profile_path: Path, window_path: Path, prediction: dict, shape) -> dict:
    """The prediction taken apart per MoE layer (moe_mesh/planning/simulate.py), to set next to
    what the router measures."""
    from common.perfmodel import split
    from common.placement import parse_experts
    from moe_mesh.planning.plan import read_record
    from moe_mesh.planning.profile_format import read_profile
    from moe_mesh.planning.search import costs, expert_shares, layer_shares, planning_load
    from moe_mesh.planning.simulate import Node, experts_per_call, simulate

    profile = read_profile(profile_path)
    record = read_record(window_path)
    c = costs(profile, prediction["transport"])
    groups = [parse_experts(g["experts"], shape) for g in prediction["plan"]["expert_groups"]]
    replicas = [g["replicas"] for g in prediction["plan"]["expert_groups"]]
    load = planning_load(profile, record.load)
    per_expert = expert_shares(profile.moe_layers, groups, load)
    shares = layer_shares(per_expert)
    names = [g["name"] for g in prediction["plan"]["expert_groups"]]
    nodes = tuple(
        Node(
            n["kind"],
            profile.cores,
            n["router"],
            tuple(names.index(x) for x in n["expert_groups"]),
        )
        for n in prediction["plan"]["nodes"]
    )
    b, m = prediction["batch_size"], prediction["micro_batches"]
    prefill = prediction.get("prefill_tokens_per_step", 0.0)
    step = simulate(c, shares, replicas, nodes, b, m, per_expert, prefill)
    factor = (prediction.get("calibration") or {}).get("factor", 1.0)
    rt = next(n for n in nodes if n.router).threads
    et = min((n.threads for n in nodes if n.replicas), default=1)
    parts = split(b, m)
    tokens = [p * (1 + prefill / b) for p in parts]  # with its share of the prompts' tokens
    smax = [max(row) for row in shares]

    def ms(x: float) -> float:
        return round(x * 1e3, 4)

    per_micro_batch = [
        {
            "b": p,
            "tokens": round(t, 2),
            "ta_ms": ms(c.ta.time(t, rt)),
            "ta_measured_wall_ms": ms(c.ta.wall(t)),
            "ta_cpu_ms": ms(c.ta.cpu(t)),
            "te_all_experts_ms": ms(c.te.time(t, et)),
            "te_busiest_group_ms": ms(max(smax) * c.te.time(t, et)),
            "tc_one_way_ms": ms(
                c.tc(max(smax) * t * profile.top_k * profile.bytes_per_token) if smax else 0.0
            ),
            "busiest_call_service_cpu_ms_if_one_expert": ms(
                c.service_cpu(max(smax) * t * profile.top_k * profile.bytes_per_token)
            ),
            "busiest_call_router_cpu_ms_if_one_expert": ms(
                c.router_cpu(max(smax) * t * profile.top_k * profile.bytes_per_token)
            ),
            "head_ms": ms(c.head.time(p, rt)),
        }
        for p, t in zip(parts, tokens)
    ]
    router_cpu = sum(c.head.cpu(p) for p in parts)
    experts_cpu = router_calls = service_calls = 0.0
    experts_in_calls = []
    if c.dense is not None:
        router_cpu += sum(c.dense_layers * c.dense.cpu(t) for t in tokens)
    for row, experts in zip(shares, per_expert):
        for t in tokens:
            calls = [
                (x * t * profile.top_k * profile.bytes_per_token, experts_per_call(e, t, c.top_k))
                for x, e in zip(row, experts)
                if x > 0
            ]
            experts_in_calls += [k for _, k in calls]
            router_calls += sum(c.router_cpu(v, k) for v, k in calls)
            service_calls += sum(c.service_cpu(v, k) for v, k in calls)
            router_cpu += c.ta.cpu(t)
            experts_cpu += sum(x * c.te.cpu(t) for x in row)
    transport = profile.transports[prediction["transport"]]
    return {
        "router_cpu_ms_per_step": ms(router_cpu + router_calls),
        "router_per_call_cpu_ms_per_step": ms(router_calls),
        "experts_cpu_ms_per_step": ms(experts_cpu + service_calls),
        "experts_per_call_cpu_ms_per_step": ms(service_calls),
        "mean_experts_per_call": round(sum(experts_in_calls) / max(1, len(experts_in_calls)), 2),
        "per_call_cpu": "measured"
        if transport.service_call_cpu and transport.router_call_cpu
        else f"one Tc per call at each end ({transport.cpu_skipped or 'format 1 profile'})",
        "router_threads": rt,
        "expert_threads": et,
        "micro_batches": parts,
        "prefill_tokens_per_step": prefill,
        "moe_layers": len(shares),
        "busiest_group_share_per_layer": [round(s, 4) for s in smax],
        "per_micro_batch": per_micro_batch,
        "step_ms": ms(step.seconds),
        "pipeline_ms": ms(step.pipeline_s),
        "pipeline_per_moe_layer_ms": ms(step.pipeline_s / max(1, len(shares))),
        "bound": step.bound,
        "calibration_factor": factor,
        "reproduces_prediction": abs(step.seconds * factor * 1e3 - prediction["predicted_tpot_ms"])
        < 1e-6,
    }


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--workdir", type=Path, help="default .cache/plan-check-<time>")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/plan_check.json")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--tpot-slo-ms", type=float, default=2000.0, help="generous: any plan")
    parser.add_argument("--max-num-seqs", type=int, help="largest B searched (default 32)")
    parser.add_argument("--inventory", type=Path, default=ROOT / "deploy/inventory.example.yaml")
    parser.add_argument("--base", type=Path, default=ROOT / "deploy/plan.example.yaml")
    parser.add_argument("--profile-repeats", type=int, default=20)
    parser.add_argument("--profile-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--traffic-requests", type=int, default=8)
    parser.add_argument("--waves", type=int, default=3, help="requests measured = waves x B")
    parser.add_argument("--status-every-s", type=float, default=5.0)
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="reuse the profile and utilization record already in --workdir",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound of each command")
    args = parser.parse_args()

    if not (args.checkpoint / "config.json").exists():
        from moe_mesh.dev.create_checkpoint import create_checkpoint

        create_checkpoint(args.checkpoint, "mixtral", "small", seed=0, progress=True)
    ckpt = args.checkpoint.resolve()
    workdir = args.workdir or ROOT / f".cache/plan-check-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(workdir)
    L, N = args.input_len, args.output_len
    context = L + N // 2  # the mean KV length over a request's decode
    files = {
        "workdir": str(workdir),
        "profile": str(workdir / "profile.json"),
        "traffic_bench": str(workdir / "traffic.json"),
        "window": str(workdir / "window.json"),
        "traffic_status": str(workdir / "traffic-status.json"),
        "base_plan": str(workdir / "base.yaml"),
        "plan": str(workdir / "plan.yaml"),
        "prediction": str(workdir / "prediction.json"),
        "bench": str(workdir / "bench.json"),
    }
    paths = {k: Path(v) for k, v in files.items()}

    # 1. profile
    if args.reuse and paths["profile"].exists():
        say(f"profile: reusing {paths['profile']}")
    else:
        runner.run(
            "profile",
            [
                "profile",
                "--checkpoint",
                str(ckpt),
                "--out",
                files["profile"],
                "--context",
                str(context),
                "--sizes",
                args.profile_sizes,
                "--repeats",
                str(args.profile_repeats),
            ],
            args.timeout_s,
        )
    profile = json.loads(paths["profile"].read_text())

    # 2. utilization record
    if args.reuse and paths["window"].exists():
        say(f"utilization record: reusing {paths['window']}")
    else:
        mesh = Mesh(runner, "up-utilization", ["up", "--checkpoint", str(ckpt)], args.timeout_s)
        try:
            runner.run(
                "traffic",
                [
                    "bench",
                    "--ready-file",
                    str(mesh.ready_file),
                    "--concurrency",
                    "4",
                    "--num-requests",
                    str(args.traffic_requests),
                    "--input-len",
                    str(L),
                    "--output-len",
                    str(N),
                    "--quiet",
                    "--out",
                    files["traffic_bench"],
                ],
                args.timeout_s,
                stdout=workdir / "traffic.out",
            )
            runner.run(
                "traffic-status",
                ["status", "--ready-file", str(mesh.ready_file), "--json"],
                120,
                stdout=paths["traffic_status"],
            )
            runner.run(
                "placement-show",
                ["placement", "show", "--ready-file", str(mesh.ready_file), "--json"],
                120,
                stdout=paths["window"],
            )
        finally:
            mesh.stop()

    # 3. plan search
    base_changes = base_plan(args.base, profile, paths["base_plan"])
    search = [
        "plan",
        "--search",
        "--profile",
        files["profile"],
        "--utilization",
        files["window"],
        "--inventory",
        str(args.inventory),
        "--base",
        files["base_plan"],
        "--tpot-slo-ms",
        f"{args.tpot_slo_ms:g}",
        "--out",
        files["plan"],
        "--prediction-out",
        files["prediction"],
        "--input-len",
        str(L),
        "--output-len",
        str(N),
        "--calibrate-bench",
        files["traffic_bench"],
        "--calibrate-status",
        files["traffic_status"],
    ]
    if args.max_num_seqs:
        search += ["--max-num-seqs", str(args.max_num_seqs)]
    runner.run("plan-search", search, args.timeout_s)
    print((workdir / "plan-search.log").read_text(), end="", flush=True)
    prediction = json.loads(paths["prediction"].read_text())
    plan = yaml.safe_load(paths["plan"].read_text())

    from common.placement import ModelShape

    shape = ModelShape(profile["num_layers"], profile["num_experts"], tuple(profile["moe_layers"]))
    up = translate(plan, prediction, shape, profile["cores"])
    model = breakdown(paths["profile"], paths["window"], prediction, shape)
    b = prediction["batch_size"]
    say(
        f"plan: B={b} m={prediction['micro_batches']} {prediction['transport']} "
        f"{len(plan['expert_groups'])} group(s); predicted {prediction['predicted_tokens_per_s']:.1f} "
        f"tokens/s, TPOT {prediction['predicted_tpot_ms']:.2f} ms ({prediction['bound']})"
    )

    # 4-5. run the plan and measure it
    mesh = Mesh(runner, "up-plan", ["up", "--checkpoint", str(ckpt), *up["up_flags"]], 600)
    try:
        for s in up["scale"]:
            runner.run(
                f"scale-{len(runner.commands)}",
                [
                    "scale",
                    "--ready-file",
                    str(mesh.ready_file),
                    "--experts",
                    s["experts"],
                    "--replicas",
                    str(s["replicas"]),
                ],
                300,
            )
        before = wait_placement(mesh.ready_file, shape, up["expected_placement"], 60)
        measure = [
            "bench",
            "--ready-file",
            str(mesh.ready_file),
            "--concurrency",
            str(b),
            "--num-requests",
            str(args.waves * b),
            "--input-len",
            str(L),
            "--output-len",
            str(N),
            "--max-duration-s",
            str(int(args.timeout_s)),
            "--quiet",
            "--out",
            files["bench"],
        ]
        cmd = [*CLI, *measure]
        log = workdir / "bench.log"
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
        after = status(mesh.ready_file)
    finally:
        mesh.stop()

    point = json.loads(paths["bench"].read_text())["setups"][0]["points"][0]
    tpot_p50_ms = point["tpot_ms"]["p50"]
    measured = b / (tpot_p50_ms / 1e3)
    predicted = prediction["predicted_tokens_per_s"]
    ratio = measured / predicted
    factor = (prediction.get("calibration") or {}).get("factor", 1.0)
    router_after = after.get("routers", [{}])[0]
    steps = router_after.get("steps", 0) - before.get("routers", [{}])[0].get("steps", 0)
    cpu = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
    cpu["bench client + status polls"] = sum(
        getattr(children_after, f) - getattr(children_before, f) for f in ("ru_utime", "ru_stime")
    )
    wall = runner.commands[-1]["seconds"]
    roles = {}
    for name, secs in cpu.items():
        role = name.split("-")[0] if name.startswith(("expert-", "router-")) else name
        roles[role] = roles.get(role, 0.0) + secs
    cpu_report = {
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
    if steps:
        # Next to the model's CPU per step; the harness (gateway, launcher, bench client) is not
        # modelled: what the prediction would be if its CPU shared the one node, for the report.
        per_step = cpu_report["cpu_ms_per_step"]
        harness = sum(
            per_step.get(k, 0.0)
            for k in ("gateway", "launcher (registry)", "bench client + status polls")
        )
        modelled = model["router_cpu_ms_per_step"] + model["experts_cpu_ms_per_step"]
        cpu_report["model_vs_measured_cpu_ms_per_step"] = {
            "router": [model["router_cpu_ms_per_step"], per_step.get("router")],
            "expert": [model["experts_cpu_ms_per_step"], per_step.get("expert")],
        }
        cpu_report["harness_cpu_ms_per_step"] = round(harness, 2)
        if len(prediction["plan"]["nodes"]) == 1:
            cpu_report["predicted_tpot_with_harness_cpu_ms"] = round(
                max(prediction["predicted_tpot_ms"], (modelled + harness) / profile["cores"]), 2
            )
    # The gateway belongs to a deployment (the bench client does not): its CPU per output token,
    # measured here and not modelled; what a step of B tokens would cost with it on the node.
    out_tokens = point["completed"] * N  # the warm-up request's aside
    if out_tokens:
        per_token = {
            k: round(roles.get(k, 0.0) / out_tokens * 1e3, 3)
            for k in ("gateway", "bench client + status polls")
        }
        cpu_report["cpu_ms_per_output_token"] = per_token
        if steps and len(prediction["plan"]["nodes"]) == 1:
            with_gateway = modelled + per_token["gateway"] * b
            cpu_report["predicted_tpot_with_gateway_cpu_ms"] = round(
                max(prediction["predicted_tpot_ms"], with_gateway / profile["cores"]), 2
            )
    result = {
        "checkpoint": str(ckpt),
        "model_id": profile["model_id"],
        "workload": {"input_len": L, "output_len": N, "profile_context": context},
        "predicted": {
            "decode_tokens_per_s": predicted,
            "tpot_ms": prediction["predicted_tpot_ms"],
            "pipeline_tpot_ms": prediction["pipeline_tpot_ms"],
            "bound": prediction["bound"],
            "calibration": prediction.get("calibration"),
        },
        "ratio_measured_over_uncalibrated_model": ratio / factor,
        "measured": {
            "decode_tokens_per_s": measured,
            "tpot_p50_ms": tpot_p50_ms,
            "tpot_ms": point["tpot_ms"],
            "itl_ms": point["itl_ms"],
            "ttft_ms": point["ttft_ms"],
            "output_tokens_per_s": point["output_throughput"],
            "completed": point["completed"],
            "failed": point["failed"],
            "duration_s": point["duration_s"],
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
        "base_plan_changes": base_changes,
        "up": up,
        "model_breakdown": model,
        "cpu_during_bench": cpu_report,
        "router_status": {
            "before_bench": before.get("routers", [{}])[0].get("micro_batches"),
            "after_bench": router_after.get("micro_batches"),
            "placement": router_after.get("placement"),
            "transports": sorted({x["transport"] for x in router_after.get("replicas", [])}),
            "samples_during_bench": samples,
        },
        "files": files,
        "commands": runner.commands,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    say(
        f"predicted {predicted:.1f} tokens/s (TPOT {prediction['predicted_tpot_ms']:.1f} ms), "
        f"measured {measured:.1f} tokens/s (B={b} / TPOT p50 {tpot_p50_ms:.1f} ms; output "
        f"{point['output_throughput']:.1f} tokens/s): ratio {ratio:.2f}, within 20%: "
        f"{result['within_20_percent']} (the model uncalibrated: ratio {ratio / factor:.2f}; "
        f"calibration factor {factor:.3f})"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
