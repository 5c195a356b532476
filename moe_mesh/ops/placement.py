"""`moe-mesh placement show`: where every expert runs and how hot it is, mesh-wide.

The record built here (`placement_record`, printed by `--json`) is what `moe-mesh plan` reads: the
utilization window summed over routers, each router's colocated tier and each expert service's
experts. `render` draws it for a terminal, `write_png` as a picture.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import typing
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from common.cli import add_settings_arguments, settings_from_args
from common.errors import (
    InvalidArgumentError,
    MoeMeshError,
    PreconditionError,
    UnavailableError,
)
from common.placement import Pair, format_experts
from moe_mesh.ops import tables
from moe_mesh.ops.client import client_tls, router_status
from moe_mesh.ops.coverage import COLOCATED, pairs_of
from moe_mesh.ops.ready import read_ready_file

BLOCK = 16  # experts per heatmap block: 16 cells of 5 characters keep a block under 100 columns
LEGEND = "H colocated (hot tier)   P pinned hot   r pinned remote   blank: on an expert service"


def placement_record(router_rows: list[dict]) -> dict:
    """The mesh-wide utilization record from `router_status` rows; routers whose Status failed are skipped."""
    rows = []
    for row in router_rows:
        if "error" in row:
            print(
                f"warning: router {row['address']} skipped: Status failed ({row['error']})",
                file=sys.stderr,
            )
        else:
            rows.append(row)
    if not rows:
        failed = ", ".join(f"{r['address']} ({r['error']})" for r in router_rows)
        raise UnavailableError(f"no router answered Status: {failed or 'no router given'}")
    first = rows[0]
    model = ("model_id", "num_layers", "num_experts")
    for row in rows[1:]:
        # Summing windows of different models would be meaningless.
        if any(row[k] != first[k] for k in model):
            raise PreconditionError(
                f"routers serve different models: {first['address']} has "
                f"{[first[k] for k in model]}, {row['address']} has {[row[k] for k in model]}"
            )
    layers, experts = first["num_layers"], first["num_experts"]
    # Routers report placement as explicit pairs (format_experts), so any layer may parse here.
    shape = {"num_layers": layers, "num_experts": experts, "moe_layers": range(layers)}
    placed = [{b: pairs_of(spec, shape) for b, spec in r["placement"].items()} for r in rows]
    moe_layers = list(first["moe_layers"])
    utilization = [[0.0] * experts for _ in range(layers)]
    tokens = [[0] * experts for _ in range(layers)]
    for row in rows:
        for total, counts in ((utilization, row["utilization"]), (tokens, row["tokens_routed"])):
            for layer, values in enumerate(counts):
                for e, v in enumerate(values):
                    total[layer][e] += v
    record = {
        "model_id": first["model_id"],
        "num_layers": layers,
        "num_experts": experts,
        "moe_layers": moe_layers,
        "window_s": first["window_s"],
        "expert_bytes": first["expert_bytes"],
        "utilization": utilization,
        "tokens_routed": tokens,
    }
    record["routers"] = [
        {
            "address": r["address"],
            "region": r["region"],
            "colocated": r["placement"].get(COLOCATED, ""),
            "precision": r["precisions"].get(COLOCATED, ""),
            "colocated_bytes": r["colocated_bytes"],
            "budget_bytes": r["budget_bytes"],
            "promotions": r["promotions"],
            "demotions": r["demotions"],
            "pinned_hot": r["pinned_hot"],
            "pinned_remote": r["pinned_remote"],
        }
        for r in rows
    ]
    services: dict[str, tuple[str, str, set[Pair]]] = {}
    for row, backends in zip(rows, placed):
        for backend, pairs in backends.items():
            if backend != COLOCATED:
                # Routers may see a service's membership at different moments: keep every pair any saw.
                region, precision, seen = services.get(backend, ("", "", set()))
                region = region or row["regions"].get(backend, "")
                precision = precision or row["precisions"].get(backend, "")
                services[backend] = (region, precision, seen | pairs)
    record["services"] = [
        {
            "address": a,
            "region": region,
            "precision": precision,
            "experts": format_experts(sorted(pairs)),
        }
        for a, (region, precision, pairs) in sorted(services.items())
    ]
    return record


def shares(row: list[float]) -> list[int]:
    """Each expert's share of a layer's tokens in whole percent, rounded so the layer adds up to exactly 100."""
    total = sum(row)
    if not total:
        return [0] * len(row)
    exact = [100 * v / total for v in row]
    out = [int(x) for x in exact]
    # Largest remainder: the percent points lost to truncation go to the cells that lost the most.
    for i in sorted(range(len(row)), key=lambda i: out[i] - exact[i])[: 100 - sum(out)]:
        out[i] += 1
    return out


def tier_marks(record: dict) -> dict[Pair, str]:
    """'P' pinned hot, 'H' colocated, 'r' pinned remote on any router; pairs on expert services are absent."""
    marks: dict[Pair, str] = {}
    for key, mark in (
        ("pinned_remote", "r"),
        ("colocated", "H"),
        ("pinned_hot", "P"),
    ):  # later marks win
        for router in record["routers"]:
            marks.update(dict.fromkeys(pairs_of(router[key], record), mark))
    return marks


def render(record: dict) -> str:
    """Routers table, services table and the utilization heatmap, readable in 100 columns."""
    mib = 2**20
    routers = [
        [
            r["address"],
            r["region"] or "-",
            f"{r['colocated_bytes'] / mib:.1f} / "
            + (f"{r['budget_bytes'] / mib:.1f}" if r["budget_bytes"] else "off"),
            f"+{r['promotions']} -{r['demotions']}",
            r["colocated"] or "-",
            r["precision"] or "-",
            f"{r['pinned_hot'] or '-'} / {r['pinned_remote'] or '-'}",
        ]
        for r in record["routers"]
    ]
    services = [
        [s["address"], s["region"] or "-", s["precision"] or "-", s["experts"]]
        for s in record["services"]
    ]
    return "\n\n".join(
        [
            tables.table(
                [
                    "router",
                    "region",
                    "colocated MiB / budget",
                    "moves",
                    "colocated",
                    "precision",
                    "pinned hot / remote",
                ],
                routers,
            ),
            tables.table(["expert service", "region", "precision", "experts"], services)
            if services
            else "no expert services",
            _heatmap(record),
        ]
    )


def _heatmap(record: dict) -> str:
    moe, util = record["moe_layers"], record["utilization"]
    per_layer = sum(sum(util[layer]) for layer in moe) / len(moe) if moe else 0
    lines = [
        f"{record['model_id']}: share of each MoE layer's routed tokens, % "
        f"({per_layer:,.0f} routed per layer in the last {record['window_s']:g}s)",
        LEGEND,
    ]
    marks = tier_marks(record)
    percent = {layer: shares(util[layer]) for layer in moe}
    # Above BLOCK experts the table wraps into blocks of BLOCK experts, each with its own header.
    for start in range(0, record["num_experts"], BLOCK):
        block = range(start, min(start + BLOCK, record["num_experts"]))
        lines += ["", "layer" + "".join(f" {e:>3} " for e in block).rstrip()]
        lines += [
            f"{layer:>5}"
            + "".join(
                f" {percent[layer][e]:>3}{marks.get((layer, e), ' ')}" for e in block
            ).rstrip()
            for layer in moe
        ]
    return "\n".join(lines)


def write_png(record: dict, path: Path) -> None:
    """The utilization heatmap as a PNG: share per MoE layer (rows) x expert (columns), colocated outlined."""
    moe = record["moe_layers"]
    marks = tier_marks(record)
    row_of = {layer: i for i, layer in enumerate(moe)}
    rows = [record["utilization"][layer] for layer in moe]
    heatmap_png(
        [[100 * v / (sum(row) or 1) for v in row] for row in rows],
        path,
        f"{record['model_id']}: expert utilization, last {record['window_s']:g}s (outlined: colocated)",
        [(row_of[layer], e) for (layer, e), m in marks.items() if m in "HP" and layer in row_of],
        row_labels=[str(layer) for layer in moe],
        colorbar_label="% of the layer's routed tokens",
    )


def heatmap_png(
    matrix: list[list[float]],
    path: Path,
    title: str,
    marks: Iterable[tuple[int, int]] = (),
    *,
    row_labels: list[str] | None = None,
    xlabel: str = "expert",
    ylabel: str = "layer",
    colorbar_label: str = "",
) -> None:
    """A rows x columns heatmap of non-negative values, a colorbar, the (row, column) cells in `marks` outlined."""
    if not matrix or not matrix[0]:
        raise InvalidArgumentError(
            "heatmap", "nothing to draw: the matrix is empty (no MoE layers reported?)"
        )
    # Imported here: matplotlib costs a noticeable part of a second, and only --png needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    rows, cols = len(matrix), len(matrix[0])
    cell = min(
        0.45, 20 / max(rows, cols)
    )  # inches; square cells, large matrices scaled down to stay printable
    fig = Figure(figsize=(cols * cell + 2.5, rows * cell + 1.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # The scale starts at 0 so a cold cell looks cold; an all-zero matrix (an idle window) still gets a scale.
    image = ax.imshow(
        matrix,
        cmap="viridis",
        aspect="equal",
        interpolation="nearest",
        vmin=0,
        vmax=max(map(max, matrix)) or 1,
    )
    fig.colorbar(image, ax=ax, label=colorbar_label, shrink=0.9)
    for r, c in marks:
        ax.add_patch(
            Rectangle(
                (c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5, clip_on=False
            )
        )  # unclipped: cells on the border keep all four sides
    if cols <= 32:
        ax.set_xticks(range(cols))
    if rows <= 32:
        ax.set_yticks(range(rows), labels=row_labels)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.title.set_fontsize("small")
    fig.savefig(path, format="png", dpi=100)


class ShowSettings(BaseModel):
    """`moe-mesh placement show`'s flags: which routers to ask, and how to show the answer."""

    model_config = ConfigDict(extra="forbid")

    ready_file: Path | None = Field(
        None,
        description="the file `moe-mesh up --ready-file` wrote; its routers are asked",
        json_schema_extra={"metavar": "FILE"},
    )
    routers: list[tables.HostPort] | None = Field(
        None,
        description="a router's gRPC address (repeatable)",
        json_schema_extra={"metavar": "HOST:PORT"},
    )
    as_json: bool = Field(
        False,
        description="print the record as JSON instead of tables (the window file `moe-mesh plan` "
        "reads)",
    )
    png: Path | None = Field(
        None,
        description="also draw the utilization heatmap into this PNG file",
        json_schema_extra={"metavar": "FILE"},
    )


WHERE = ("ready_file", "routers")  # one or the other
FLAGS = {"routers": "--router", "as_json": "--json"}


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `placement show` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "placement",
        help="where experts run and how hot they are",
        description="Expert placement and utilization of a running mesh.",
    )
    sub = p.add_subparsers(dest="placement_command", required=True, metavar="COMMAND")
    s = sub.add_parser(
        "show",
        help="routers' hot tiers, expert services and the utilization heatmap",
        description="Ask routers for their utilization window and placement and show them "
        "mesh-wide: which experts each router colocates, what each expert service "
        "serves, and each expert's share of its layer's tokens.",
    )
    where = s.add_mutually_exclusive_group(required=True)
    add_settings_arguments(where, ShowSettings, only=WHERE, flags=FLAGS)
    add_settings_arguments(s, ShowSettings, skip=WHERE, flags=FLAGS)
    s.set_defaults(func=run_show)


def _ready_routers(path: Path) -> list[str]:
    return list(read_ready_file(path, "routers")["routers"])


def run_show(args: argparse.Namespace) -> int:
    s = typing.cast(ShowSettings, settings_from_args(ShowSettings, args, flags=FLAGS))
    tls = client_tls(s.ready_file)

    async def ask(addresses: list[str]) -> list[dict]:
        return list(await asyncio.gather(*(router_status(a, tls) for a in addresses)))

    try:
        # The group requires --router or --ready-file.
        routers = s.routers or _ready_routers(typing.cast(Path, s.ready_file))
        record = placement_record(asyncio.run(ask(routers)))
        if s.png:
            write_png(record, s.png)
            print(f"wrote {s.png}", file=sys.stderr)
    except MoeMeshError as e:
        print(f"moe-mesh placement show: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(record) if s.as_json else render(record))
    return 0
