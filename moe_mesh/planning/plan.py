"""`moe-mesh plan`: propose a deploy plan from a recorded utilization window (see moe_mesh/planning/eplb.py).

Reads the record `moe-mesh placement show --json` writes and a base plan; writes the base plan with
its expert groups, the router's colocation budget and the model sizes replaced. The proposal is a
starting point to review and commit, not something applied live.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.cli import add_settings_arguments, settings_from_args
from common.placement import ModelShape, format_experts
from common.units import parse_size
from moe_mesh.benchmark.workload import DEFAULT_SCALE, MEDIAN_INPUT_TOKENS, MEDIAN_OUTPUT_TOKENS
from moe_mesh.planning import resources
from moe_mesh.planning.calibrate import Calibration, calibrate, observed
from moe_mesh.planning.deploy.plan import Plan, PlanError, load_plan, write_output
from moe_mesh.planning.eplb import PlanOptions, Proposal, propose
from moe_mesh.planning.inventory import load_inventory
from moe_mesh.planning.profile_format import ProfileFile, read_profile
from moe_mesh.planning.record import Record, read_record
from moe_mesh.planning.search import (
    Candidate,
    Limits,
    all_transports,
    check_match,
    planning_load,
    prediction,
    search,
    table,
)
from moe_mesh.planning.search import planned as search_planned
from moe_mesh.planning.simulate import Workload

PROG = "moe-mesh plan"
# `plan --search`'s request lengths without --input-len / --output-len: what `moe-mesh bench`
# sends by default (57 and 16 tokens, medians).
DEFAULT_INPUT_LEN = round(MEDIAN_INPUT_TOKENS * DEFAULT_SCALE)
DEFAULT_OUTPUT_LEN = round(MEDIAN_OUTPUT_TOKENS * DEFAULT_SCALE)


def planned(
    base: Plan, record: Record, proposal: Proposal, budget_bytes: int, cpu_mhz: int
) -> Plan:
    """`base` with the proposal's expert groups, the router's budget and the record's model sizes.
    Each group keeps where and how the base's first group runs (region, constraints, port, args,
    precision, autoscale; the device of the base's group of its name if any), not its size:
    memory from the bytes it holds, CPU its share of `cpu_mhz` by the load its replicas compute
    (moe_mesh/planning/resources.py)."""
    raw = base.model_dump(mode="json", exclude_defaults=True)
    template = base.expert_groups[0].model_dump(
        mode="json", exclude_defaults=True, exclude={"resources", "compute_threads", "replicas"}
    )
    cpus = resources.split_cpu(cpu_mhz, proposal.groups)
    raw["expert_groups"] = [
        {
            **template,
            "name": g.name,
            "experts": format_experts(list(g.pairs)),
            "replicas": _within_autoscale(template, g.replicas),
            "device": resources.group_device(base, g.name),
            "compute_threads": max(1, cpu // resources.MHZ_PER_CORE),
            "resources": {
                "cpu_mhz": cpu,
                "memory_mb": resources.memory_mb(len(g.pairs), record.expert_bytes),
            },
        }
        for g, cpu in zip(proposal.groups, cpus)
    ]
    raw.setdefault("router", {})["colocate_budget"] = str(budget_bytes)
    raw["model"].update(
        model_id=record.model_id,
        num_layers=record.num_layers,
        num_experts=record.num_experts,
        moe_layers=list(record.moe_layers),
    )
    return Plan.model_validate(raw)


def _within_autoscale(template: dict, replicas: int) -> int:
    """The proposal's replicas, inside the bounds of the autoscale block the groups copy."""
    bounds = template.get("autoscale") or {}
    low, high = bounds.get("min_replicas", 1), bounds.get("max_replicas", replicas)
    return min(max(replicas, low), high)


def _human(n: float) -> str:
    units = iter(("KiB", "MiB", "GiB"))
    unit = "B"
    while n >= 1024 and unit != "GiB":
        n, unit = n / 1024, next(units)
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


def summary(record: Record, proposal: Proposal, budget_bytes: int) -> str:
    total = sum(record.load.values())
    lines = [
        f"{len(record.moe_layers)} MoE layers x {record.num_experts} experts, {total:g} tokens routed in "
        f"the {record.window_s:g} s window"
    ]
    spec = format_experts(list(proposal.colocated)) if proposal.colocated else "(none)"
    lines.append(
        f"colocated in the router: {spec}  ({len(proposal.colocated)} experts, "
        f"{_human(proposal.colocated_bytes)} of the {_human(budget_bytes)} budget)"
    )
    lines.append(f"predicted in-process share of routed tokens: {proposal.in_process_share:.1%}")
    lines.append("expert groups (name, replicas, share of routed tokens, experts):")
    width = max(len(g.name) for g in proposal.groups)
    lines += [
        f"  {g.name:<{width}}  x{g.replicas}  {g.load_share:6.1%}  {format_experts(list(g.pairs))}"
        for g in proposal.groups
    ]
    lines.append(
        f"imbalance (max / mean load per remote replica): {proposal.imbalance_before:.2f} -> "
        f"{proposal.imbalance_after:.2f}"
    )
    return "\n".join(lines)


def _metavar(name: str) -> dict[str, str]:
    return {"metavar": name}


class PlanSettings(BaseModel):
    """`moe-mesh plan`'s flags: the EPLB proposal's, then those of `--search`."""

    model_config = ConfigDict(extra="forbid")

    utilization: Path | None = Field(
        None,
        description="utilization record (JSON); required, except with --search (without one: "
        "the profile's load shares, e.g. for a model not served yet)",
        json_schema_extra=_metavar("FILE"),
    )
    base: Path | None = Field(
        None,
        description="plan (YAML) to start from; new expert groups copy where and how its first "
        "group runs, and share out the CPU its groups ask for (unset: the model from the record, "
        "the rest the plan's defaults, one core per expert-service replica)",
        json_schema_extra=_metavar("PLAN"),
    )
    out: Path | None = Field(
        None,
        description="write the proposed plan here instead of stdout",
        json_schema_extra=_metavar("FILE"),
    )
    budget: str = Field(
        "25%",
        description="router colocation budget: bytes (1048576, 512MiB, 2GiB) or a percentage of "
        "all routed experts' bytes",
        json_schema_extra=_metavar("BYTES|PCT"),
    )
    groups: int = Field(
        4,
        ge=1,
        description="expert-service groups for the experts with a single replica",
        json_schema_extra=_metavar("N"),
    )
    extra_replicas: int | None = Field(
        None,
        ge=0,
        description="remote replicas to hand out beyond one per expert, hottest first "
        "(unset: MoE experts // 8)",
        json_schema_extra=_metavar("N"),
    )
    hot_factor: float = Field(
        1.5,
        ge=0,
        description="an expert may be colocated when its load is at least this times its layer's "
        "mean",
        json_schema_extra=_metavar("X"),
    )
    # --search
    search: bool = Field(False, description="search deployments instead of proposing EPLB groups")
    profile: Path | None = Field(
        None, description="what `moe-mesh profile` wrote (JSON)", json_schema_extra=_metavar("FILE")
    )
    inventory: Path | None = Field(
        None,
        description="node kinds (YAML; deploy/inventory.example.yaml)",
        json_schema_extra=_metavar("FILE"),
    )
    tpot_slo_ms: float | None = Field(
        None,
        ge=0,
        description="time per output token at most (unset: no limit)",
        json_schema_extra=_metavar("MS"),
    )
    prediction_out: Path | None = Field(
        None,
        description="write the best candidate's prediction (JSON) here",
        json_schema_extra=_metavar("FILE"),
    )
    top: int = Field(5, ge=1, description="candidates to print", json_schema_extra=_metavar("N"))
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        description="largest batch size B tried (unset: the base plan's router.max_num_seqs, "
        "else 32)",
        json_schema_extra=_metavar("N"),
    )
    input_len: int | None = Field(
        None,
        ge=0,
        description="prompt tokens per request: each step carries B x input/output of them (unset: "
        f"{DEFAULT_INPUT_LEN}, `moe-mesh bench`'s default median; 0: pure decode)",
        json_schema_extra=_metavar("N"),
    )
    output_len: int | None = Field(
        None,
        ge=1,
        description=f"output tokens per request (unset: {DEFAULT_OUTPUT_LEN}, `moe-mesh bench`'s "
        "default median)",
        json_schema_extra=_metavar("N"),
    )
    max_services: int = Field(
        8, ge=1, description="expert groups tried: 1..N", json_schema_extra=_metavar("N")
    )
    max_replicas: int = Field(
        2, ge=1, description="replicas per group tried: 1..N", json_schema_extra=_metavar("N")
    )
    calibrate_bench: Path | None = Field(
        None,
        description="calibrate the model on a measured run (moe_mesh/planning/calibrate.py): the "
        "JSON of `moe-mesh bench --concurrency B` (one point) against the mesh the utilization "
        "record came from; with --calibrate-status",
        json_schema_extra=_metavar("FILE"),
    )
    calibrate_status: Path | None = Field(
        None,
        description="`moe-mesh status --json` of that mesh after the run (its expert groups, m, "
        "transport)",
        json_schema_extra=_metavar("FILE"),
    )

    @field_validator("budget")
    @classmethod
    def _a_size(cls, text: str) -> str:
        """Checked now, resolved once the record says how many bytes 100% is."""
        parse_size(text, 0)
        return text


EPLB_FLAGS = ["utilization", "base", "out", "budget", "groups", "extra_replicas", "hot_factor"]


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "plan",
        help="propose a deploy plan from a recorded utilization window (EPLB)",
        description="Propose expert groups, redundant replicas and the router's colocation budget "
        "from the utilization record `moe-mesh placement show --json` wrote, on top of a base "
        "plan. Prints a summary to stderr and the plan (YAML) to --out or stdout.",
    )
    add_settings_arguments(p, PlanSettings, only=EPLB_FLAGS)
    search = p.add_argument_group(
        "--search",
        "MegaScale-Infer's plan search (moe_mesh/planning/search.py): predict every candidate from "
        "a profile and rank those meeting the TPOT SLO by tokens/s per cost",
    )
    add_settings_arguments(search, PlanSettings, skip=EPLB_FLAGS)  # type: ignore[arg-type]
    p.set_defaults(func=run_plan)


def _misused_flags(s: PlanSettings) -> str | None:
    """What is wrong with the combination of flags given, if anything."""
    searching = ("--profile", s.profile), ("--inventory", s.inventory)
    if s.search:
        if s.calibrate_bench is not None and s.utilization is None:
            return "--calibrate-bench needs the --utilization of the mesh it measured"
        if (s.calibrate_bench is None) != (s.calibrate_status is None):
            return "--calibrate-bench and --calibrate-status go together"
        missing = [flag for flag, value in searching if value is None]
        return f"--search needs {' and '.join(missing)}" if missing else None
    if s.utilization is None:
        return "--utilization is required (it is optional only with --search)"
    given = [
        flag
        for flag, value in (
            *searching,
            ("--input-len", s.input_len),
            ("--output-len", s.output_len),
            ("--calibrate-bench", s.calibrate_bench),
            ("--calibrate-status", s.calibrate_status),
        )
        if value is not None
    ]
    if given or s.tpot_slo_ms is not None or s.prediction_out is not None:
        return f"{', '.join(given) or 'these flags'} only go with --search"
    return None


def run_plan(args: argparse.Namespace) -> int:
    settings = typing.cast(PlanSettings, settings_from_args(PlanSettings, args))
    problem = _misused_flags(settings)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return run_search(settings) if settings.search else run_eplb(settings)
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _base(s: PlanSettings, record: Record) -> Plan:
    """The plan to start from: --base, of the record's model, or one derived from the record."""
    if s.base is None:
        return resources.base_from_record(record)
    base = load_plan(s.base)
    if record.model_id != base.model.model_id:
        source = f"the record {s.utilization}" if s.utilization else f"the profile {s.profile}"
        raise PlanError(
            f"{s.base}: model.model_id: {base.model.model_id!r}, but {source} is of "
            f"{record.model_id!r}: set model.model_id (and "
            f"model.checkpoint) in {s.base} to the served model's, or leave out --base to "
            "derive the model from the record"
        )
    return base


def run_eplb(s: PlanSettings) -> int:
    """Propose EPLB groups from the record on top of the base plan; write it, summarize to stderr."""
    assert s.utilization is not None  # _misused_flags checked
    record = read_record(s.utilization)
    base = _base(s, record)
    budget_bytes = parse_size(s.budget, len(record.load) * record.expert_bytes)
    options = PlanOptions(budget_bytes, s.groups, s.extra_replicas, s.hot_factor)
    proposal = propose(record.load, record.expert_bytes, options)
    cpu = resources.expert_cpu_mhz(None if s.base is None else base, proposal.groups)
    plan = planned(base, record, proposal, budget_bytes, cpu)
    header = (
        f"# Proposed by `moe-mesh plan` from {s.utilization} ({record.window_s:g} s window) on top "
        f"of {s.base or 'the defaults'}.\n# Review, then: moe-mesh deploy render --plan THIS_FILE "
        "--target compose|nomad|kubernetes --out DIR\n"
    )
    print(summary(record, proposal, budget_bytes), file=sys.stderr)
    print(resources.total(plan).text(), file=sys.stderr)
    write_output(header + _yaml(plan), s.out)
    if s.out is not None:
        print(f"wrote {s.out}", file=sys.stderr)
    return 0


def _yaml(plan: Plan) -> str:
    return yaml.safe_dump(plan.model_dump(mode="json", exclude_defaults=True), sort_keys=False)


@dataclass(frozen=True)
class Searched:
    """What `--search` found, and what it was found for."""

    profile: ProfileFile
    workload: Workload
    slo_s: float | None
    calibration: Calibration | None
    found: list[Candidate]  # best first
    plan: Plan  # the base plan with the best candidate


def searched(s: PlanSettings) -> Searched:
    """Read the inputs, calibrate when asked, search; every problem is a PlanError."""
    assert s.profile is not None and s.inventory is not None  # _misused_flags checked
    profile, inventory = read_profile(s.profile), load_inventory(s.inventory)
    if s.utilization is None:  # no window: every layer takes the profile's shares (planning_load)
        record = Record(
            profile.model_id,
            profile.num_layers,
            profile.num_experts,
            tuple(profile.moe_layers),
            0.0,
            profile.expert_bytes,
            {},
        )
    else:
        record = read_record(s.utilization)
        check_match(profile, record, s.profile, s.utilization)
    base = _base(s, record)
    slo = None if s.tpot_slo_ms is None else s.tpot_slo_ms / 1e3
    limits = Limits(
        s.max_num_seqs or base.router.max_num_seqs or 32, s.max_services, s.max_replicas, slo
    )
    workload = Workload(
        DEFAULT_INPUT_LEN if s.input_len is None else s.input_len,
        DEFAULT_OUTPUT_LEN if s.output_len is None else s.output_len,
    )
    calibration = None
    if s.calibrate_bench is not None and s.calibrate_status is not None:
        shape = ModelShape(profile.num_layers, profile.num_experts, tuple(profile.moe_layers))
        seen = observed(s.calibrate_bench, s.calibrate_status, shape)
        load = planning_load(profile, record.load)
        calibration = calibrate(profile, all_transports(profile), load, inventory, seen)
    scale = calibration.factor if calibration else 1.0
    found = search(profile, record.load, inventory, limits, workload, scale)
    if not found:
        raise PlanError(
            f"no candidate meets --tpot-slo-ms {s.tpot_slo_ms:g} with {s.inventory}"
            if slo is not None
            else f"no candidate fits the memory of the nodes in {s.inventory}"
        )
    plan = search_planned(base, profile, found[0], len(inventory.kinds) > 1)
    return Searched(profile, workload, slo, calibration, found, plan)


def run_search(s: PlanSettings) -> int:
    """`moe-mesh plan --search`: print the best candidates, write the best as a plan and its prediction."""
    r = searched(s)
    best = r.found[0]
    if r.calibration is not None:
        o = r.calibration.observed
        print(
            f"calibrated on {s.calibrate_bench}: {sum(o.replicas)} service(s), B={o.batch}, "
            f"m={o.m}, {o.transport}: measured TPOT {o.tpot_s * 1e3:.1f} ms, the model "
            f"{r.calibration.predicted_tpot_s * 1e3:.1f} ms; every step x {r.calibration.factor:.3f}",
            file=sys.stderr,
        )
    meet = "meet the SLO" if s.tpot_slo_ms is not None else "fit the inventory (no --tpot-slo-ms)"
    print(
        f"{len(r.found)} candidates {meet}; the best {min(s.top, len(r.found))}:", file=sys.stderr
    )
    print(table(r.found[: s.top]), file=sys.stderr)
    kinds = Counter(n.kind for n in best.nodes)
    nodes = f"{len(best.nodes)} node(s): " + ", ".join(f"{k} x{n}" for k, n in kinds.items())
    print(resources.total(r.plan).text(nodes), file=sys.stderr)
    predicted = {
        "profile": str(s.profile),
        "utilization": None if s.utilization is None else str(s.utilization),
        "model_id": r.profile.model_id,
        **prediction(best, r.slo_s, r.workload),
        "calibration": r.calibration.record() if r.calibration else None,
    }
    calibrated = f", calibrated x{r.calibration.factor:.3f}" if r.calibration else ""
    header = (
        f"# Proposed by `moe-mesh plan --search` from {s.profile} and "
        f"{s.utilization or 'its load shares'}: "
        f"B={best.batch}, m={best.m}, {best.transport}, predicted {best.tokens_per_s:.1f} tokens/s, "
        f"TPOT {best.step.seconds * 1e3:.2f} ms{calibrated}, requests of {r.workload.input_len} "
        f"prompt and {r.workload.output_len} output tokens.\n"
        f"# Review, then: moe-mesh deploy render --plan THIS_FILE --target compose|nomad|kubernetes --out DIR\n"
    )
    try:
        if s.prediction_out is not None:
            s.prediction_out.write_text(json.dumps(predicted, indent=1) + "\n")
        if s.out is None:
            sys.stdout.write(header + _yaml(r.plan))
        else:
            s.out.write_text(header + _yaml(r.plan))
    except OSError as e:
        raise PlanError(f"{e.filename}: {e.strerror}") from None
    keys = (
        "batch_size",
        "micro_batches",
        "transport",
        "predicted_tokens_per_s",
        "predicted_tpot_ms",
    )
    print(json.dumps({k: predicted[k] for k in keys}), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`plan` without the rest of the CLI (tests, and a quick `python -c` without the services' imports)."""
    parser = argparse.ArgumentParser(prog="moe-mesh")
    add_subcommand(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return args.func(args)
