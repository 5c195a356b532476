"""The benchmark's picture: output tokens/s against median TPOT, one line per set-up, a point per load
level (labelled), the usual throughput-latency trade-off curve of serving papers."""

from __future__ import annotations

from pathlib import Path

from common.errors import InvalidArgumentError


def curves(report: dict) -> dict[str, list[tuple[float, float, str]]]:
    """set-up name -> [(TPOT p50 ms, output tokens/s, load label)] of the points that have both."""
    out = {}
    for setup in report["setups"]:
        out[setup["name"]] = [
            (p["tpot_ms"]["p50"], p["output_throughput"], p["load"])
            for p in setup["points"]
            if p["tpot_ms"]["p50"] is not None and p["output_throughput"] is not None
        ]
    return out


def write_png(report: dict, path: Path) -> None:
    """Draw `report` (the benchmark's JSON) into `path`, with matplotlib's Agg backend."""
    lines = curves(report)
    if not any(lines.values()):
        raise InvalidArgumentError(
            "--png", "nothing to draw: no load point completed a request of two or more tokens"
        )
    # Imported here: matplotlib costs a noticeable part of a second, and only the picture needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in lines.items():
        if not points:
            continue
        xs, ys, labels = zip(*points)
        ax.plot(xs, ys, marker="o", label=name)
        for x, y, label in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("TPOT p50 (ms per output token)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"moe-mesh bench: {report['model']['id']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(title="set-up", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
