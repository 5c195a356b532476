"""`moe-mesh bench` as a user runs it: set-ups it starts itself on the tiny checkpoint, the JSON
report, the table and the picture; failures as one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import moe_mesh

PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_two_set_ups_at_two_concurrencies_reports_exact_tokens_and_draws(
    checkpoint, tmp_path
) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "curve.png"
    run = moe_mesh(
        "bench",
        "--checkpoint", checkpoint("mixtral"),
        "--setup", "monolithic=--expert-services 0",
        "--setup", "remote=--expert-services 2 --router-arg='--fast-path off'",
        "--num-requests", "6",
        "--concurrency", "1,2",
        "--scale", "0.05",
        "--output-len", "5",
        "--out", out,
        "--png", png,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["setups"]] == ["monolithic", "remote"]
    assert report["setups"][1]["up_args"] == [
        "--expert-services", "2", "--router-arg=--fast-path off"
    ]  # fmt: skip
    assert report["model"]["max_model_len"] > 0 and report["workload"]["output_tokens"] == 30
    for setup in report["setups"]:
        assert [p["concurrency"] for p in setup["points"]] == [1, 2]
        for p in setup["points"]:
            assert (p["requests"], p["completed"], p["failed"]) == (6, 6, 0), p["errors"]
            # ignore_eos: every request streamed exactly the tokens it asked for
            assert p["output_tokens"] == p["requested_output_tokens"] == 30
            assert p["input_tokens"] == report["workload"]["input_tokens"] > 6
            assert p["duration_s"] > 0 and p["request_throughput"] > 0
            assert p["output_throughput"] == pytest.approx(30 / p["duration_s"], rel=1e-3)
            for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
                assert 0 < p[metric]["p50"] <= p[metric]["p99"], (metric, p[metric])
            assert p["ttft_ms"]["p50"] <= p["ttft_ms"]["p90"] <= p["ttft_ms"]["p99"]
            assert p["e2e_latency_ms"]["p50"] > p["ttft_ms"]["p50"]
            assert 0 <= p["goodput"] <= p["request_throughput"]
    # the table names every set-up and load level; the picture is a PNG
    rows = [line.split()[:3] for line in run.stdout.splitlines()[1:-1]]
    assert rows == [[s, c, "6/6"] for s in ("monolithic", "remote") for c in ("c=1", "c=2")]
    assert png.read_bytes().startswith(PNG)
    # every process a set-up started is gone
    assert "==> stopping the mesh" in (tmp_path / "setups" / "remote" / "up.log").read_text()


def test_bench_against_nothing_or_a_broken_set_up_is_a_one_line_error(checkpoint, tmp_path) -> None:
    run = moe_mesh("bench", "--url", "127.0.0.1:9", "--out", tmp_path / "x.json")
    assert run.returncode == 1  # unreachable: the exit-code table's row for a failed peer
    assert run.stderr.startswith("moe-mesh bench: error: http://127.0.0.1:9/v1/models: ")
    assert "is a gateway serving there?" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "x.json").exists()

    # A router flag passed through `up --router-arg` reaches the router, which refuses it.
    bad = moe_mesh(
        "bench",
        "--checkpoint", checkpoint("mixtral"),
        "--setup", "bad=--expert-services 0 --router-arg=--max-num-seqs=0",
        "--out", tmp_path / "bad.json",
    )  # fmt: skip
    assert bad.returncode == 2
    assert "set-up 'bad'" in bad.stderr and "max-num-seqs" in bad.stderr, bad.stderr

    malformed = moe_mesh("bench", "--setup", "--expert-services 1")
    assert malformed.returncode == 2
    assert "argument --setup: expected NAME=FLAGS" in malformed.stderr
    assert "Traceback" not in malformed.stderr

    missing = moe_mesh("bench", "--setup", "a=--expert-services 1")
    assert missing.returncode == 2
    assert "moe-mesh bench: error: --checkpoint: required with --setup" in missing.stderr
