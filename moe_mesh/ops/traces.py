"""`moe-mesh trace show`: one request's spans across services, as an indented tree.

Every service process writes its finished spans to its own JSON-lines file (`JsonLinesSpanExporter`),
so a trace is put together from several files: spans are grouped by trace id and linked by parent id.
Spans whose parent is in none of the files given hang under a "(parent not in the files)" node.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections import Counter, defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field

from common.cli import add_settings_arguments, settings_from_args
from common.errors import InvalidArgumentError, MoeMeshError, NotFoundError
from moe_mesh.ops.ready import read_ready_file
from moe_mesh.ops.tables import table

# Attributes worth a place on a span's line, with the short name shown there.
SHOWN = {
    "moe.layer": "layer",
    "moe.transport": "transport",
    "moe.replica": "replica",
    "moe.region": "region",
    "moe.experts": "experts",
    "moe.tokens": "tokens",
    "moe.expert_tokens": "expert_tokens",
    "moe.bytes": "bytes",
    "moe.batch.size": "batch",
    "gen_ai.request.max_tokens": "max_tokens",
    "gen_ai.usage.input_tokens": "input_tokens",
    "gen_ai.usage.output_tokens": "output_tokens",
    "rpc.method": "method",
    "rpc.grpc.status_code": "grpc",
}
SIBLINGS_SHOWN = 20  # a request's decode steps x layers repeat one span name hundreds of times
MISSING_PARENT = "(parent not in the files)"
GRPC_CODES = {
    code.value[0]: code.name for code in grpc.StatusCode
}  # the gRPC instrumentation records numbers


def load_spans(paths: Iterable[Path]) -> list[dict]:
    """Spans of JSON-lines files as flat dicts: trace_id, span_id, parent_id (bare hex, parent None at a root),
    name, service, start and end (s since the epoch), attributes, status, error (description or None).

    Blank lines are skipped, malformed ones warned about on stderr; an unreadable file raises MoeMeshError.
    A span seen twice (a file given twice) is kept once."""
    spans: dict[tuple[str, str], dict] = {}
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise MoeMeshError(f"cannot read {path}: {e}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                span = _flat(json.loads(line))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                print(
                    f"warning: {path}:{number}: not a span, skipped ({type(e).__name__}: {e})",
                    file=sys.stderr,
                )
                continue
            spans.setdefault((span["trace_id"], span["span_id"]), span)
    return list(spans.values())


def _flat(raw: dict) -> dict:
    """The SDK's `ReadableSpan.to_json()` form reduced to what the tree needs; KeyError etc. when it is not one."""
    status = raw.get("status") or {}
    return {
        "trace_id": _bare(raw["context"]["trace_id"]),
        "span_id": _bare(raw["context"]["span_id"]),
        "parent_id": _bare(raw["parent_id"]) if raw.get("parent_id") else None,
        "name": str(raw["name"]),
        "service": str(raw.get("resource", {}).get("attributes", {}).get("service.name", "?")),
        "start": _seconds(raw["start_time"]),
        "end": _seconds(raw["end_time"]),
        "attributes": dict(raw.get("attributes") or {}),
        "error": (status.get("description") or "")
        if status.get("status_code") == "ERROR"
        else None,
    }


def _bare(span_or_trace_id: str) -> str:
    """Ids without the SDK's 0x prefix, lowercase: what a user pastes into --trace-id may be either."""
    text = span_or_trace_id.strip().lower()
    return text[2:] if text.startswith("0x") else text


def _seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def traces(spans: list[dict]) -> dict[str, list[dict]]:
    """Spans by trace id, each trace's spans in start order."""
    out: dict[str, list[dict]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: s["start"]):
        out[span["trace_id"]].append(span)
    return dict(out)


def _roots(trace: list[dict]) -> list[dict]:
    """Spans without a parent within the trace's spans: exactly one when the trace is complete."""
    ids = {s["span_id"] for s in trace}
    return [s for s in trace if s["parent_id"] not in ids]


# Calls that keep the mesh running rather than serve a request: left out unless asked for.
_CONTROL = ("/Check", "/Watch", "/Status", "/Describe", "/ListModels")
GATEWAY_REQUEST = "moe.gateway.request"


def is_control(trace: list[dict]) -> bool:
    """A health check, Status, Describe or ListModels call (its root span is the RPC's)."""
    roots = _roots(trace) or trace
    return roots[0]["name"].endswith(_CONTROL)


def pick(by_trace: dict[str, list[dict]], trace_id: str | None = None) -> str:
    """The trace asked for, else the latest complete trace holding a gateway request, else the latest
    complete one that is not a control call (health, Status, Describe), else the latest of all."""
    if not by_trace:
        raise NotFoundError(
            "no spans in the files (`moe-mesh up` traces 1% of requests unless told otherwise: "
            "`up --trace-sample 1` traces every one)"
        )
    if trace_id is not None:
        if _bare(trace_id) not in by_trace:
            raise NotFoundError(
                f"no trace {_bare(trace_id)} in the files (they hold {len(by_trace)} "
                f"trace{'s' * (len(by_trace) != 1)}; --list shows them)"
            )
        return _bare(trace_id)
    complete = [t for t, spans in by_trace.items() if len(_roots(spans)) == 1]
    requests = [t for t in complete if any(s["name"] == GATEWAY_REQUEST for s in by_trace[t])]
    served = [t for t in complete if not is_control(by_trace[t])]
    for candidates in (requests, served, complete):
        if candidates:
            return max(candidates, key=lambda t: _roots(by_trace[t])[0]["start"])
    return max(by_trace, key=lambda t: by_trace[t][0]["start"])


def render_trace(
    spans: list[dict], trace_id: str | None = None, max_depth: int | None = None
) -> str:
    """A header line and the span tree of one trace (see `pick`), children in start order, depth 0 the root."""
    by_trace = traces(spans)
    trace = by_trace[pick(by_trace, trace_id)]
    start = trace[0]["start"]
    ids = {s["span_id"] for s in trace}
    children: dict[str | None, list[dict]] = defaultdict(list)
    for span in trace:
        children[span["parent_id"] if span["parent_id"] in ids else None].append(span)
    roots = children.pop(None, [])
    orphans = [s for s in roots if s["parent_id"] is not None]
    services = sorted({s["service"] for s in trace})
    header = (
        f"trace {trace[0]['trace_id']}  services {', '.join(services)}  {len(trace)} spans  "
        f"{1000 * (max(s['end'] for s in trace) - start):.3f} ms"
    )
    if len(roots) != 1:
        header += f"  (partial: {len(roots)} spans without a parent in the files)"
    lines = [header]
    _lines([s for s in roots if s["parent_id"] is None], children, start, 0, max_depth, lines)
    if orphans and max_depth == 0:
        lines.append(
            f"{MISSING_PARENT}  (+{sum(1 + _count(s, children) for s in orphans)} spans below)"
        )
    elif orphans:
        lines.append(MISSING_PARENT)
        _lines(orphans, children, start, 1, max_depth, lines)
    return "\n".join(lines)


def _lines(
    siblings: list[dict],
    children: dict[str | None, list[dict]],
    start: float,
    depth: int,
    max_depth: int | None,
    out: list[str],
) -> None:
    total = Counter(s["name"] for s in siblings)
    seen: Counter[str] = Counter()
    for span in siblings:  # already in start order: `traces` sorted them
        seen[span["name"]] += 1
        if seen[span["name"]] > SIBLINGS_SHOWN:
            # The summary takes the place of the first hidden span.
            if seen[span["name"]] == SIBLINGS_SHOWN + 1:
                out.append(
                    f"{'  ' * depth}... {total[span['name']] - SIBLINGS_SHOWN} more {span['name']} spans"
                )
            continue
        kids = children.get(span["span_id"], [])
        line = _line(span, start, depth)
        if kids and max_depth is not None and depth >= max_depth:
            out.append(f"{line}  (+{_count(span, children)} spans below)")
            continue
        out.append(line)
        _lines(kids, children, start, depth + 1, max_depth, out)


def _count(span: dict, children: dict[str | None, list[dict]]) -> int:
    return sum(1 + _count(kid, children) for kid in children.get(span["span_id"], []))


def _line(span: dict, start: float, depth: int) -> str:
    parts = [
        f"{'  ' * depth}{span['name']}",
        f"[{span['service']}]",
        f"{1000 * (span['end'] - span['start']):.3f} ms",
        f"+{1000 * (span['start'] - start):.3f} ms",
    ]
    attrs = " ".join(
        f"{short}={_value(key, span['attributes'][key])}"
        for key, short in SHOWN.items()
        if key in span["attributes"]
    )
    if attrs:
        parts.append(attrs)
    if span["error"] is not None:
        parts.append(f"ERROR {span['error']}".rstrip())
    return "  ".join(parts)


def _value(key: str, value: object) -> str:
    if key == "rpc.grpc.status_code" and isinstance(value, int):
        return GRPC_CODES.get(value, str(value))
    if isinstance(value, list):
        text = ",".join(map(str, value))
        return text if len(text) <= 40 else text[:37] + "..."  # a layer's expert list can be long
    return str(value)


def render_list(spans: list[dict], everything: bool = False) -> str:
    """One line per trace in start order: id, root, start, duration, spans, services. Control calls
    (health, Status, Describe) only with `everything`; a last line counts those left out."""
    if not spans:
        raise NotFoundError(
            "no spans in the files (`moe-mesh up` traces 1% of requests unless told otherwise: "
            "`up --trace-sample 1` traces every one)"
        )
    rows, hidden = [], 0
    for trace_id, trace in traces(spans).items():
        if not everything and is_control(trace):
            hidden += 1
            continue
        roots = _roots(trace)
        root = (roots or trace)[0]  # no root at all only in a file with a parent cycle
        when = datetime.fromtimestamp(trace[0]["start"], UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        rows.append(
            [
                trace_id,
                root["name"] + ("" if len(roots) == 1 else " (partial)"),
                root["service"],
                when,
                f"{1000 * (max(s['end'] for s in trace) - trace[0]['start']):.3f}",
                str(len(trace)),
                ",".join(sorted({s["service"] for s in trace})),
            ]
        )
    listed = table(
        ["trace id", "root span", "root service", "start (UTC)", "ms", "spans", "services"], rows
    )
    return listed + (
        f"\n({hidden} health/Status/Describe calls not shown; --all)" if hidden else ""
    )


class ShowSettings(BaseModel):
    """`moe-mesh trace show`'s arguments."""

    model_config = ConfigDict(extra="forbid")

    files: list[Path] = Field(
        [],
        description="JSON-lines span files, one per service process (give all of a trace's "
        "services); with --ready-file, more besides the mesh's",
        json_schema_extra={"metavar": "FILE"},
    )
    ready_file: Path | None = Field(
        None,
        description="the file `moe-mesh up --ready-file` wrote: read the span files of every "
        "service of that mesh (its trace_files)",
        json_schema_extra={"metavar": "FILE"},
    )
    trace_id: str | None = Field(
        None,
        description="the trace to show, 32 hex digits with or without 0x; unset: the latest "
        "complete trace holding a gateway request",
        json_schema_extra={"metavar": "ID"},
    )
    list_traces: bool = Field(
        False, description="list the traces in the files instead of showing one"
    )
    all_spans: bool = Field(
        False,
        description="with --list, also the health checks and Status/Describe calls (left out by "
        "default)",
    )
    max_depth: int | None = Field(
        None,
        ge=0,
        description="show spans down to this depth only, the root being 0; unset: all",
        json_schema_extra={"metavar": "N"},
    )


FLAGS = {"files": "files", "list_traces": "--list", "all_spans": "--all"}


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `trace show` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "trace",
        help="read the span files services write",
        description="Traces from the JSON-lines span files of the services (--trace-file).",
    )
    sub = p.add_subparsers(dest="trace_command", required=True, metavar="COMMAND")
    s = sub.add_parser(
        "show",
        help="one request's spans across services as a tree",
        description="Put a trace together from the span files of several services and print its "
        "span tree: duration, offset from the trace's start and the key attributes "
        "of every span. Without --trace-id, the latest complete trace holding a gateway request.",
    )
    add_settings_arguments(s, ShowSettings, flags=FLAGS)
    s.set_defaults(func=run_show)


def span_files(files: list[Path], ready_file: Path | None) -> list[Path]:
    """The files given, and those of the mesh `ready_file` describes; InvalidArgumentError when
    there are none (a mesh started with --trace-sample 0 writes no spans)."""
    if ready_file is not None:
        mesh = read_ready_file(ready_file, "trace_files")
        if not mesh["trace_files"] and not files:
            raise InvalidArgumentError(
                "--ready-file",
                f"the mesh of {ready_file} writes no spans (started with --trace-sample 0); "
                "restart it with `moe-mesh up --trace-sample R`",
            )
        # A service that has died or not yet started has no file: the others' spans still show.
        files = [*files, *(Path(f) for f in mesh["trace_files"] if Path(f).exists())]
    if not files:
        raise InvalidArgumentError(
            "--ready-file", "give the ready file of `moe-mesh up` or span files (FILE ...)"
        )
    return files


def run_show(args: argparse.Namespace) -> int:
    s = typing.cast(ShowSettings, settings_from_args(ShowSettings, args, flags=FLAGS))
    try:
        files = span_files(s.files, s.ready_file)
        spans = load_spans(files)
        print(
            render_list(spans, s.all_spans)
            if s.list_traces
            else render_trace(spans, s.trace_id, s.max_depth)
        )
    except MoeMeshError as e:
        print(f"moe-mesh trace show: error: {e}", file=sys.stderr)
        return 2
    return 0
