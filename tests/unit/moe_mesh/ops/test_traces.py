"""`moe-mesh trace show`: span files written by real tracer providers, put together into one tree."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.errors import NotFoundError
from common.telemetry import JsonLinesSpanExporter
from moe_mesh.ops import traces as trace_view
from moe_mesh.ops.traces import load_spans, render_trace

T0 = 1_800_000_000 * 10**9  # ns, a whole second: offsets print exactly
MS = 10**6
STEPS = 25  # decode steps under one router span: more than SIBLINGS_SHOWN


class Service:
    """A tracer provider of one service writing its own span file, as a service process does."""

    def __init__(self, name: str, path: Path) -> None:
        self.path = path
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}))
        self.provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
        self.tracer = self.provider.get_tracer("moe_mesh")

    def span(
        self,
        name: str,
        start_ms: float,
        end_ms: float,
        parent: trace.Span | None = None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        error: str | None = None,
        at: int = T0,
        attributes: dict | None = None,
    ) -> trace.Span:
        context = trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(
            name,
            context=context,
            kind=kind,
            start_time=at + int(start_ms * MS),
            attributes=attributes,
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=at + int(end_ms * MS))
        return span


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Two requests through gateway -> router -> expert, each service writing its own file.

    The earlier request is short; the later one decodes STEPS steps and fails one expert call."""
    gateway = Service("gateway", tmp_path / "gateway.jsonl")
    router = Service("router", tmp_path / "router.jsonl")
    expert = Service("expert", tmp_path / "expert.jsonl")
    early = T0 - 10_000 * MS
    # Parents end after their children: start the parent first, end it last (spans are written when they end).
    root = gateway.tracer.start_span("gateway.Generate", kind=SpanKind.SERVER, start_time=early)
    gateway.span("router.GenerateStream", 1, 9, root, kind=SpanKind.CLIENT, at=early)
    root.end(end_time=early + 10 * MS)

    root = gateway.tracer.start_span(
        "gateway.Generate",
        kind=SpanKind.SERVER,
        start_time=T0,
        attributes={"gen_ai.request.max_tokens": 32, "rpc.method": "GenerateStream"},
    )
    call = gateway.tracer.start_span(
        "router.GenerateStream",
        trace.set_span_in_context(root),
        kind=SpanKind.CLIENT,
        start_time=T0 + 2 * MS,
    )
    serve = router.tracer.start_span(
        "router.Generate",
        trace.set_span_in_context(call),
        kind=SpanKind.SERVER,
        start_time=T0 + 3 * MS,
        attributes={"gen_ai.usage.input_tokens": 4},
    )
    for step in range(STEPS):
        at = 10 + 3 * step
        parent = router.tracer.start_span(
            "router.step",
            trace.set_span_in_context(serve),
            start_time=T0 + at * MS,
            attributes={"moe.batch.size": 1},
        )
        dispatch = router.tracer.start_span(
            "dispatch",
            trace.set_span_in_context(parent),
            start_time=T0 + (at + 1) * MS,
            kind=SpanKind.CLIENT,
            attributes={"moe.layer": 1, "moe.transport": "grpc", "moe.experts": [0, 3]},
        )
        if step == 0:
            expert.span(
                "expert.Forward",
                at + 1.25,
                at + 1.75,
                dispatch,
                kind=SpanKind.SERVER,
                error="expert 3 not loaded",
                attributes={"moe.tokens": 2, "rpc.grpc.status_code": 5},
            )
        dispatch.end(end_time=T0 + (at + 2) * MS)
        parent.end(end_time=T0 + (at + 2.5) * MS)
    serve.end(end_time=T0 + 100 * MS)
    call.end(end_time=T0 + 101 * MS)
    root.end(end_time=T0 + 110 * MS)
    for service in (gateway, router, expert):
        service.provider.shutdown()
    return {"gateway": gateway.path, "router": router.path, "expert": expert.path}


def show(*argv) -> int:
    parser = argparse.ArgumentParser()
    trace_view.add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["trace", "show", *map(str, argv)])
    return args.func(args)


def trace_ids(files: dict[str, Path]) -> list[str]:
    """Trace ids in start order: the short request's, then the long one's."""
    return list(trace_view.traces(load_spans(files.values())))


def test_tree_across_three_files_latest_trace_by_default(files) -> None:
    spans = load_spans(files.values())
    assert (
        len(spans) == 2 + 3 + 2 * STEPS + 1
    )  # the short request; the long one's gateway, router, expert spans
    assert all(not s["trace_id"].startswith("0x") and len(s["trace_id"]) == 32 for s in spans)
    lines = render_trace(spans).splitlines()
    long_id = trace_ids(files)[1]
    assert lines[0] == (
        f"trace {long_id}  services expert, gateway, router  {3 + 2 * STEPS + 1} spans  110.000 ms"
    )
    assert (
        lines[1]
        == "gateway.Generate  [gateway]  110.000 ms  +0.000 ms  max_tokens=32 method=GenerateStream"
    )
    assert lines[2] == "  router.GenerateStream  [gateway]  99.000 ms  +2.000 ms"
    assert lines[3] == "    router.Generate  [router]  97.000 ms  +3.000 ms  input_tokens=4"
    assert lines[4] == "      router.step  [router]  2.500 ms  +10.000 ms  batch=1"
    assert (
        lines[5]
        == "        dispatch  [router]  1.000 ms  +11.000 ms  layer=1 transport=grpc experts=0,3"
    )
    assert lines[6] == (
        "          expert.Forward  [expert]  0.500 ms  +11.250 ms  tokens=2 grpc=NOT_FOUND  "
        "ERROR expert 3 not loaded"
    )
    # Siblings in start order, indented by depth; steps beyond the 20th collapse into one line.
    steps = [i for i, line in enumerate(lines) if line.startswith("      router.step ")]
    offsets = [float(re.search(r"\+([\d.]+) ms", lines[i]).group(1)) for i in steps]
    assert offsets == sorted(offsets) and len(steps) == trace_view.SIBLINGS_SHOWN
    assert lines[-1] == f"      ... {STEPS - trace_view.SIBLINGS_SHOWN} more router.step spans"
    assert all(lines[i + 1].startswith("        dispatch  [router]") for i in steps)


def test_trace_id_with_or_without_0x_and_unknown_ids(files, capsys) -> None:
    short_id = trace_ids(files)[0]
    spans = load_spans(files.values())
    assert render_trace(spans, "0x" + short_id) == render_trace(spans, short_id.upper())
    assert render_trace(spans, short_id).splitlines()[1:] == [
        "gateway.Generate  [gateway]  10.000 ms  +0.000 ms",
        "  router.GenerateStream  [gateway]  8.000 ms  +1.000 ms",
    ]
    assert show(*files.values(), "--trace-id", f"0x{short_id}") == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[0]
        .startswith(f"trace {short_id}  services gateway  2 spans")
    )
    with pytest.raises(NotFoundError, match="hold 2 traces"):
        render_trace(spans, "0" * 32)
    assert show(*files.values(), "--trace-id", "abc") == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "moe-mesh trace show: error: no trace abc in the files (they hold 2 traces"
    )


def test_list_one_line_per_trace(files, capsys) -> None:
    assert show(*files.values(), "--list") == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == [
        "trace",
        "id",
        "root",
        "span",
        "root",
        "service",
        "start",
        "(UTC)",
        "ms",
        "spans",
        "services",
    ]
    short_id, long_id = trace_ids(files)
    assert [r.split()[0] for r in rows] == [short_id, long_id]
    assert rows[0].split()[1:3] == ["gateway.Generate", "gateway"] and rows[0].split()[-3:] == [
        "10.000",
        "2",
        "gateway",
    ]
    assert rows[1].split()[-3:] == ["110.000", str(3 + 2 * STEPS + 1), "expert,gateway,router"]
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", rows[1])


def test_spans_whose_parent_file_is_missing_hang_under_a_pseudo_node(files) -> None:
    lines = render_trace(load_spans([files["router"], files["expert"]])).splitlines()
    assert lines[0].startswith(f"trace {trace_ids(files)[1]}  services expert, router  ")
    assert "partial" not in lines[0]  # one span without a parent among these: the router's root
    assert lines[1] == trace_view.MISSING_PARENT
    assert lines[2].startswith("  router.Generate  [router]  97.000 ms  +0.000 ms")
    assert lines[3].startswith("    router.step  [router]")
    only_expert = render_trace(load_spans([files["expert"]])).splitlines()
    assert only_expert[1:] == [trace_view.MISSING_PARENT, only_expert[2]]
    assert only_expert[2].startswith("  expert.Forward  [expert]  0.500 ms  +0.000 ms")


def test_without_a_complete_trace_the_latest_is_shown_as_partial(files) -> None:
    router_steps = [s for s in load_spans([files["router"]]) if s["name"] == "router.step"]
    lines = render_trace(router_steps).splitlines()  # 25 roots-to-be, none of their parents here
    assert lines[0].endswith(
        f"{STEPS} spans  {3 * (STEPS - 1) + 2.5:.3f} ms  "
        f"(partial: {STEPS} spans without a parent in the files)"
    )
    assert lines[1] == trace_view.MISSING_PARENT and lines[-1] == "  ... 5 more router.step spans"


def test_max_depth_counts_what_it_hides(files, capsys) -> None:
    lines = render_trace(load_spans(files.values()), max_depth=1).splitlines()
    assert lines[1:] == [
        "gateway.Generate  [gateway]  110.000 ms  +0.000 ms  max_tokens=32 method=GenerateStream",
        f"  router.GenerateStream  [gateway]  99.000 ms  +2.000 ms  (+{1 + 2 * STEPS + 1} spans "
        "below)",
    ]
    assert show(*files.values(), "--max-depth", "0") == 0
    assert capsys.readouterr().out.splitlines()[1].endswith(f"(+{2 + 2 * STEPS + 1} spans below)")
    with pytest.raises(SystemExit):
        show(*files.values(), "--max-depth", "-1")
    assert (
        "--max-depth: Input should be greater than or equal to 0, got '-1'"
        in capsys.readouterr().err
    )


def test_malformed_lines_are_warned_about_and_skipped(files, capsys) -> None:
    path = files["gateway"]
    path.write_text(path.read_text() + "\n{not json\n" + '{"name": "no context"}\n')
    assert show(*files.values()) == 0
    out, err = capsys.readouterr()
    blank = len(path.read_text().splitlines()) - 2
    assert f"warning: {path}:{blank + 1}: not a span, skipped (JSONDecodeError" in err
    assert f"warning: {path}:{blank + 2}: not a span, skipped (KeyError" in err
    assert f"{path}:{blank}:" not in err  # the blank line is no span either, but no news
    assert out.splitlines()[1].startswith("gateway.Generate  [gateway]  110.000 ms")


def test_unreadable_or_empty_files_exit_2(files, tmp_path, capsys) -> None:
    assert show(files["gateway"], tmp_path / "missing.jsonl") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-mesh trace show: error: cannot read {tmp_path / 'missing.jsonl'}: ")
    (tmp_path / "empty.jsonl").write_text("\n")
    for flags in ([], ["--list"]):
        assert show(tmp_path / "empty.jsonl", *flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("moe-mesh trace show: error: no spans in the files (")
        assert "--trace-sample 1" in err  # the fix: sample every request


def test_registered_on_the_moe_mesh_cli(files, capsys) -> None:
    from moe_mesh.cli import build_parser

    args = build_parser().parse_args(["trace", "show", str(files["gateway"]), "--list"])
    assert args.func(args) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_the_default_trace_holds_a_gateway_request_and_control_calls_are_not_listed(
    tmp_path,
) -> None:
    gw = Service("gateway", tmp_path / "gateway.jsonl")
    root = gw.span("/moe_mesh.v1.Inference/GenerateStream", 0, 50, kind=SpanKind.SERVER)
    gw.span("moe.gateway.request", 1, 49, root)
    # Later, and complete too: a health check and a Describe, as a prober or `moe-mesh status` makes.
    gw.span("/grpc.health.v1.Health/Check", 100, 101, kind=SpanKind.SERVER)
    gw.span("/moe_mesh.v1.ExpertService/Describe", 200, 201, kind=SpanKind.SERVER)
    gw.provider.shutdown()
    spans = load_spans([gw.path])
    request = format(root.get_span_context().trace_id, "032x")
    assert trace_view.pick(trace_view.traces(spans)) == request
    listed = trace_view.render_list(spans)
    assert request in listed and "v1.Health/Check" not in listed
    assert "ExpertService/Describe" not in listed
    assert "(2 health/Status/Describe calls not shown; --all)" in listed
    everything = trace_view.render_list(spans, everything=True)
    assert "Health/Check" in everything and "ExpertService/Describe" in everything


def test_the_ready_file_names_the_span_files(files, tmp_path, capsys) -> None:
    """`--ready-file` as every other command takes it; a file not written yet is left out."""
    ready = tmp_path / "mesh.json"
    gone = tmp_path / "never-started.spans.jsonl"
    ready.write_text(json.dumps({"trace_files": [*map(str, files.values()), str(gone)]}))
    assert show("--ready-file", ready) == 0
    by_ready = capsys.readouterr().out
    assert show(*files.values()) == 0
    assert by_ready == capsys.readouterr().out and "services expert, gateway, router" in by_ready


def test_a_ready_file_without_spans_or_nothing_at_all_exit_2(tmp_path, capsys) -> None:
    ready = tmp_path / "mesh.json"
    ready.write_text(json.dumps({"trace_files": []}))
    assert show("--ready-file", ready) == 2
    assert "--ready-file: the mesh of" in capsys.readouterr().err
    ready.write_text(json.dumps({"gateway_grpc": "127.0.0.1:1"}))
    assert show("--ready-file", ready) == 2
    assert "not a ready file of `moe-mesh up` (no trace_files)" in capsys.readouterr().err
    assert show() == 2
    assert "give the ready file" in capsys.readouterr().err
