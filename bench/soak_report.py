"""What bench/soak.py measured, against its targets, and its plot (load, replicas, p99 TPOT)."""

from __future__ import annotations

from pathlib import Path

SCALE_UP_BOUND_S = 30.0  # load step -> new replica serving: a decision (2 s), the rate window
# filling with the new load (8 s), a replica loading and registering (~9 s here under load)
RSS_GROWTH = 0.05


def phase_times(phases) -> dict[str, tuple[float, float]]:
    out, begin = {}, 0.0
    for p in phases:
        out[p.name] = (begin, begin + p.seconds)
        begin += p.seconds
    return out


def _flag(flags: list[str], name: str) -> float:
    words = " ".join(flags).split()
    return float(words[words.index(name) + 1])


def analyse(soak, expected: dict[int, tuple], decisions: list[dict], flags: list[str]) -> dict:
    times = phase_times(soak.phases)
    window = _flag(flags, "--scale-down-window-s")
    changes = [
        d | {"t": d["at"] - soak.wall0} for d in decisions if d.get("action") in ("up", "down")
    ]
    results = soak.warm_up_results + [r for _, r in soak.results]
    failed = [r for r in results if r.error]
    changed = [r for r in results if not r.error and (r.tokens, r.finish) != expected[r.key]]
    groups = sorted({g for s in soak.samples for g in s["replicas"]})
    step_at, drop_at = times["step"][0], times["drop"][0]
    up_delay = {
        g: _first(changes, g, "up", step_at) - step_at
        if _first(changes, g, "up", step_at)
        else None
        for g in groups
    }
    down_after = {
        g: _first(changes, g, "down", drop_at) - drop_at
        if _first(changes, g, "down", drop_at)
        else None
        for g in groups
    }
    hold = times["hold"]
    flaps = {g: _most_in_window(changes, g, hold, window) for g in groups}
    first, last = soak.samples[0], soak.samples[-1]  # after the warm-up, and once all is back
    growth = {
        n: round(last["processes"][n]["rss_mib"] / p["rss_mib"] - 1, 4)
        for n, p in first["processes"].items()
        if p["rss_mib"] and last["processes"].get(n, {}).get("rss_mib")
    }
    fds = {
        n: (p["fds"], last["processes"].get(n, {}).get("fds"))
        for n, p in soak.samples[0]["processes"].items()
    }
    back = last["replicas"] == soak.samples[0]["replicas"]
    met = {
        "0 failed, 0 changed": bool(results) and not failed and not changed,
        "scale-up bound": all(v is not None and v <= SCALE_UP_BOUND_S for v in up_delay.values()),
        "scale-down after window": all(v is not None and v >= window for v in down_after.values()),
        "<= 1 change per window": all(v <= 1 for v in flaps.values()),
        "RSS growth < 5%": bool(growth) and all(v < RSS_GROWTH for v in growth.values()),
        "fds back to start": back and all(a == b for a, b in fds.values()),
    }
    figures = {
        "0 failed, 0 changed": f"{len(results)} requests, {len(failed)} failed, {len(changed)} changed",
        "scale-up bound": f"{_rounded(up_delay)} s from the step (bound {SCALE_UP_BOUND_S:g} s)",
        "scale-down after window": f"first scale-down {_rounded(down_after)} s after the drop (window {window:g} s)",
        "<= 1 change per window": f"most changes in a {window:g} s window of the hold: {flaps}",
        "RSS growth < 5%": f"{growth} (from t={first['t']:.0f} s to the end)",
        "fds back to start": f"{fds} (start, end); replicas back to start: {back}",
    }
    return {
        "bench": "soak",
        "policy": flags,
        "phases": {n: [round(a, 1), round(b, 1)] for n, (a, b) in times.items()},
        "requests": len(results),
        "warm_up_requests": len(soak.warm_up_results),
        "failed": len(failed),
        "changed": len(changed),
        "errors": sorted({r.error for r in failed})[:5],
        "scale_up_s": up_delay,
        "scale_down_after_s": down_after,
        "changes_per_window_in_hold": flaps,
        "rss_growth": growth,
        "fds_start_end": fds,
        "decisions": changes,
        "samples": soak.samples,
        "met": met,
        "figures": figures,
    }


def _first(changes: list[dict], group: str, action: str, after: float) -> float | None:
    return next(
        (
            c["t"]
            for c in changes
            if c["group"] == group and c["action"] == action and c["t"] >= after
        ),
        None,
    )


def _most_in_window(
    changes: list[dict], group: str, span: tuple[float, float], window: float
) -> int:
    """The most replica-count changes of `group` within any `window` seconds inside `span`."""
    ts = [c["t"] for c in changes if c["group"] == group and span[0] <= c["t"] <= span[1]]
    return max((sum(1 for u in ts if t <= u < t + window) for t in ts), default=0)


def _rounded(values: dict) -> dict:
    return {k: None if v is None else round(v, 1) for k, v in values.items()}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    t = [s["t"] for s in samples]
    fig, (load, replicas, tpot) = plt.subplots(3, 1, sharex=True, figsize=(10, 8))
    load.step(t, [s["streams"] for s in samples], where="post")
    load.set_ylabel("concurrent streams")
    for group in sorted({g for s in samples for g in s["replicas"]}):
        replicas.step(t, [s["replicas"].get(group, 0) for s in samples], where="post", label=group)
    replicas.set_ylabel("replicas")
    replicas.legend(title="expert group", loc="upper left")
    tpot.plot(t, [s["tpot_p99_ms"] for s in samples], marker=".", linestyle="-")
    tpot.set_ylabel("p99 TPOT (ms), last 10 s")
    tpot.set_xlabel("seconds")
    for ax in (load, replicas, tpot):
        for a, _ in report["phases"].values():
            ax.axvline(a, color="grey", linewidth=0.5)
        ax.grid(alpha=0.3)
    for name, (a, _) in report["phases"].items():
        load.text(a, load.get_ylim()[1], name, fontsize=8, va="top")
    fig.suptitle("moe-mesh autoscaler soak (bench/soak.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
