"""What bench/plan_check.py computes from a plan (a helper module, not a bench of its own): the
base plan it searches from, the chosen plan as `moe-mesh up` flags, the model's prediction taken
apart per MoE layer, and processes' CPU seconds."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import yaml

from moe_mesh.planning.record import read_record


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


def breakdown(profile_path: Path, window_path: Path, prediction: dict, shape) -> dict:
    """The prediction taken apart per MoE layer (moe_mesh/planning/simulate.py), to set next to
    what the router measures."""
    from common.perfmodel import split
    from common.placement import parse_experts
    from moe_mesh.planning.profile_format import read_profile
    from moe_mesh.planning.search import costs, expert_shares, layer_shares, planning_load
    from moe_mesh.planning.simulate import Node, simulate

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
    per_micro_batch = _per_micro_batch(c, profile, parts, tokens, smax, rt, et)
    router_cpu, router_calls, experts_cpu, service_calls, experts_in_calls = _cpu_per_step(
        c, profile, shares, per_expert, parts, tokens
    )

    transport = profile.transports[prediction["transport"]]
    return {
        "router_cpu_ms_per_step": _ms(router_cpu + router_calls),
        "router_per_call_cpu_ms_per_step": _ms(router_calls),
        "experts_cpu_ms_per_step": _ms(experts_cpu + service_calls),
        "experts_per_call_cpu_ms_per_step": _ms(service_calls),
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
        "step_ms": _ms(step.seconds),
        "pipeline_ms": _ms(step.pipeline_s),
        "pipeline_per_moe_layer_ms": _ms(step.pipeline_s / max(1, len(shares))),
        "bound": step.bound,
        "calibration_factor": factor,
        "reproduces_prediction": abs(step.seconds * factor * 1e3 - prediction["predicted_tpot_ms"])
        < 1e-6,
    }


def _ms(x: float) -> float:
    return round(x * 1e3, 4)


def _per_micro_batch(c, profile, parts, tokens, smax, rt: int, et: int) -> list[dict]:
    """The model's times of each micro-batch's pieces: attention, experts, transfer, head."""
    ms = _ms
    return [
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


def _cpu_per_step(c, profile, shares, per_expert, parts, tokens) -> tuple:
    """CPU seconds of one step: the router's compute, its calls, the experts' compute, theirs."""
    from moe_mesh.planning.simulate import experts_per_call

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
    return router_cpu, router_calls, experts_cpu, service_calls, experts_in_calls
