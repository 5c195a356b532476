"""`moe-mesh plan`: propose a deploy plan from a recorded utilization window (see moe_mesh/planning/eplb.py).

Reads the record `moe-mesh placement show --json` writes and a base plan; writes the base plan with
its expert groups, the router's colocation budget and the model sizes replaced. The proposal is a
starting point to review and commit, not something applied live.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.placement import Pair, format_experts
from common.units import parse_size
from moe_mesh.benchmark.workload import DEFAULT_SCALE, MEDIAN_INPUT_TOKENS, MEDIAN_OUTPUT_TOKENS
from moe_mesh.planning.deploy.plan import Plan, PlanError, load_plan, write_output
from moe_mesh.planning.eplb import PlanOptions, Proposal, propose

PROG = "moe-mesh plan"
# `plan --search`'s request lengths without --input-len / --output-len: what `moe-mesh bench`
# sends by default (57 and 16 tokens, medians).
DEFAULT_INPUT_LEN = round(MEDIAN_INPUT_TOKENS * DEFAULT_SCALE)
DEFAULT_OUTPUT_LEN = round(MEDIAN_OUTPUT_TOKENS * DEFAULT_SCALE)


@dataclass(frozen=True)
class Record:
    """The parts of a utilization record the planner reads."""

    model_id: str
    num_layers: int
    num_experts: int
    moe_layers: tuple[int, ...]
    window_s: float
    expert_bytes: int
    load: dict[Pair, float]  # MoE pairs only


def read_record(path: Path) -> Record:
    """Read and check a utilization record; every problem is a PlanError 'FILE: key: message'."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"{path}: cannot read the utilization record ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise PlanError(
            f"{path}: expected a JSON object as `moe-mesh placement show --json` writes"
        )

    def field(key: str, kind: type, low: float | None = None) -> Any:
        if key not in raw:
            raise PlanError(f"{path}: {key}: missing (`moe-mesh placement show --json` writes it)")
        return _checked(path, key, raw[key], kind, low)

    model_id = field("model_id", str)
    num_layers, num_experts = field("num_layers", int, 1), field("num_experts", int, 1)
    window_s, expert_bytes = field("window_s", float, 0), field("expert_bytes", int, 1)
    moe_layers = field("moe_layers", list)
    for i, layer in enumerate(moe_layers):
        _checked(path, f"moe_layers[{i}]", layer, int, 0)
        if layer >= num_layers or moe_layers.count(layer) > 1:
            raise PlanError(
                f"{path}: moe_layers[{i}]: layer {layer} is repeated or not below num_layers "
                f"{num_layers}"
            )
    if not moe_layers:
        raise PlanError(f"{path}: moe_layers: empty; the model has no routed experts to place")
    rows = field("utilization", list)
    if len(rows) != num_layers:
        raise PlanError(
            f"{path}: utilization: expected {num_layers} rows of {num_experts} experts, got "
            f"{len(rows)} rows"
        )
    for layer, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != num_experts:
            got = f"{len(row)} experts" if isinstance(row, list) else repr(row)
            raise PlanError(
                f"{path}: utilization[{layer}]: expected a row of {num_experts} experts, got {got}"
            )
    # Rows of dense layers are ignored whatever they hold: the router records nothing there.
    load = {
        (layer, e): _checked(path, f"utilization[{layer}][{e}]", rows[layer][e], float, 0)
        for layer in sorted(moe_layers)
        for e in range(num_experts)
    }
    return Record(
        model_id, num_layers, num_experts, tuple(sorted(moe_layers)), window_s, expert_bytes, load
    )


def _checked(path: Path, key: str, value: Any, kind: type, low: float | None = None) -> Any:
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
    what = {str: "a string", int: "an integer", float: "a number", list: "a list"}[kind]
    if not ok or (low is not None and value < low):
        bound = f" >= {low:g}" if low is not None else ""
        raise PlanError(f"{path}: {key}: expected {what}{bound}, got {value!r}")
    return float(value) if kind is float else value


def _size(text: str) -> str:
    """--budget: checked now, resolved once the record says how many bytes 100% is."""
    try:
        parse_size(text, 0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _at_least(low: int, kind: type = int) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value >= low:  # `not >=` also rejects nan
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'} >= {low}, got {text!r}"
            )
        return value

    return parse


def planned(base: Plan, record: Record, proposal: Proposal, budget_bytes: int) -> Plan:
    """`base` with the proposal's expert groups, the router's budget and the record's model sizes."""
    raw = base.model_dump(mode="json", exclude_defaults=True)
    template = base.expert_groups[0].model_dump(mode="json", exclude_defaults=True)
    raw["expert_groups"] = [
        {
            **template,
            "name": g.name,
            "experts": format_experts(list(g.pairs)),
            "replicas": g.replicas,
        }
        for g in proposal.groups
    ]
    raw.setdefault("router", {})["colocate_budget"] = str(budget_bytes)
    raw["model"].update(
        num_layers=record.num_layers,
        num_experts=record.num_experts,
        moe_layers=list(record.moe_layers),
    )
    return Plan.model_validate(raw)


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


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "plan",
        help="propose a deploy plan from a recorded utilization window (EPLB)",
        description="Propose expert groups, redundant replicas and the router's colocation budget from the "
        "utilization record `moe-mesh placement show --json` wrote, on top of a base plan. "
        "Prints a summary to stderr and the plan (YAML) to --out or stdout.",
    )
    p.add_argument(
        "--utilization", type=Path, required=True, metavar="FILE", help="utilization record (JSON)"
    )
    p.add_argument(
        "--base",
        type=Path,
        required=True,
        metavar="PLAN",
        help="plan (YAML) to start from; new expert groups copy the settings of its first group",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the proposed plan here (default stdout)",
    )
    p.add_argument(
        "--budget",
        type=_size,
        default="25%",
        metavar="BYTES|PCT",
        help="router colocation budget: bytes (1048576, 512MiB, 2GiB) or a percentage of all "
        "routed experts' bytes (default 25%%)",
    )
    p.add_argument(
        "--groups",
        type=_at_least(1),
        default=4,
        metavar="N",
        help="expert-service groups for the experts with a single replica (default 4)",
    )
    p.add_argument(
        "--extra-replicas",
        type=_at_least(0),
        default=None,
        metavar="N",
        help="remote replicas to hand out beyond one per expert, hottest first "
        "(default: MoE experts // 8)",
    )
    p.add_argument(
        "--hot-factor",
        type=_at_least(0, float),
        default=1.5,
        metavar="X",
        help="an expert may be colocated when its load is at least this times its layer's mean "
        "(default 1.5)",
    )
    search = p.add_argument_group(
        "--search",
        "MegaScale-Infer's plan search (moe_mesh/planning/search.py): predict every candidate from "
        "a profile and rank those meeting the TPOT SLO by tokens/s per cost",
    )
    search.add_argument(
        "--search", action="store_true", help="search deployments instead of proposing EPLB groups"
    )
    search.add_argument(
        "--profile", type=Path, metavar="FILE", help="what `moe-mesh profile` wrote (JSON)"
    )
    search.add_argument(
        "--inventory",
        type=Path,
        metavar="FILE",
        help="node kinds (YAML; deploy/inventory.example.yaml)",
    )
    search.add_argument(
        "--tpot-slo-ms",
        type=_at_least(0, float),
        default=None,
        metavar="MS",
        help="time per output token at most (default: no limit)",
    )
    search.add_argument(
        "--prediction-out",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the best candidate's prediction (JSON) here",
    )
    search.add_argument(
        "--top", type=_at_least(1), default=5, metavar="N", help="candidates to print (5)"
    )
    search.add_argument(
        "--max-num-seqs",
        type=_at_least(1),
        default=None,
        metavar="N",
        help="largest batch size B tried (default: the base plan's router.max_num_seqs, else 32)",
    )
    search.add_argument(
        "--input-len",
        type=_at_least(0),
        default=None,
        metavar="N",
        help="prompt tokens per request: each step carries B x input/output of them "
        f"(default {DEFAULT_INPUT_LEN}, `moe-mesh bench`'s default median; 0: pure decode)",
    )
    search.add_argument(
        "--output-len",
        type=_at_least(1),
        default=None,
        metavar="N",
        help=f"output tokens per request (default {DEFAULT_OUTPUT_LEN}, `moe-mesh bench`'s "
        "default median)",
    )
    search.add_argument(
        "--max-services",
        type=_at_least(1),
        default=8,
        metavar="N",
        help="expert groups tried: 1..N (8)",
    )
    search.add_argument(
        "--max-replicas",
        type=_at_least(1),
        default=2,
        metavar="N",
        help="replicas per group tried: 1..N (2)",
    )
    search.add_argument(
        "--calibrate-bench",
        type=Path,
        default=None,
        metavar="FILE",
        help="calibrate the model on a measured run (moe_mesh/planning/calibrate.py): the JSON of "
        "`moe-mesh bench --concurrency B` (one point) against the mesh the utilization record "
        "came from; with --calibrate-status",
    )
    search.add_argument(
        "--calibrate-status",
        type=Path,
        default=None,
        metavar="FILE",
        help="`moe-mesh status --json` of that mesh after the run (its expert groups, m, "
        "transport)",
    )
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    searching = ("--profile", args.profile), ("--inventory", args.inventory)
    calibrating = [args.calibrate_bench is None, args.calibrate_status is None]
    if args.search and calibrating.count(True) == 1:
        print(
            f"{PROG}: error: --calibrate-bench and --calibrate-status go together", file=sys.stderr
        )
        return 2
    if args.search:
        missing = [flag for flag, value in searching if value is None]
        if missing:
            print(f"{PROG}: error: --search needs {' and '.join(missing)}", file=sys.stderr)
            return 2
        from moe_mesh.planning.search import run_search

        return run_search(args)
    given = [flag for flag, value in searching if value is not None]
    given += [
        flag
        for flag, value in (
            ("--input-len", args.input_len),
            ("--output-len", args.output_len),
            ("--calibrate-bench", args.calibrate_bench),
            ("--calibrate-status", args.calibrate_status),
        )
        if value is not None
    ]
    if given or args.tpot_slo_ms is not None or args.prediction_out is not None:
        print(
            f"{PROG}: error: {', '.join(given) or 'these flags'} only go with --search",
            file=sys.stderr,
        )
        return 2
    try:
        record, base = read_record(args.utilization), load_plan(args.base)
        if record.model_id != base.model.model_id:
            raise PlanError(
                f"{args.utilization}: model_id: the record is of {record.model_id!r} but "
                f"{args.base} serves {base.model.model_id!r}"
            )
        budget_bytes = parse_size(args.budget, len(record.load) * record.expert_bytes)
        options = PlanOptions(budget_bytes, args.groups, args.extra_replicas, args.hot_factor)
        proposal = propose(record.load, record.expert_bytes, options)
        plan = planned(base, record, proposal, budget_bytes)
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    header = (
        f"# Proposed by `moe-mesh plan` from {args.utilization} ({record.window_s:g} s window) on top of "
        f"{args.base}.\n# Review, then: moe-mesh deploy render --plan THIS_FILE --target compose|nomad|kubernetes "
        f"--out DIR\n"
    )
    text = header + yaml.safe_dump(
        plan.model_dump(mode="json", exclude_defaults=True), sort_keys=False
    )
    print(summary(record, proposal, budget_bytes), file=sys.stderr)
    try:
        write_output(text, args.out)
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.out is not None:
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`plan` without the rest of the CLI (tests, and a quick `python -c` without the services' imports)."""
    parser = argparse.ArgumentParser(prog="moe-mesh")
    add_subcommand(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return args.func(args)
