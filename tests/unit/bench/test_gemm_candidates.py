"""bench/gemm_candidates.py: every candidate's products are F.linear's (to bfloat16 rounding),
the geometry's shapes are its layers', and a candidate that cannot run is recorded while the
others still run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bench import gemm_candidates as gc
from bench.geometry import GEOMETRIES, geometry_spec
from common import bf16


def test_the_shapes_are_a_qwen3_slice_layers() -> None:
    spec = geometry_spec(GEOMETRIES["qwen3-30b-a3b-slice"])
    assert gc.shapes(spec) == {
        "qkv": (5120, 2048),
        "o": (2048, 4096),
        "gate_up": (1536, 2048),
        "down": (2048, 768),
        "lm_head": (spec.vocab_size, 2048),
    }


# inductor's own warnings (torch.utils.mkldnn's torch.jit, its storages), not this bench's
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize("name", gc.CANDIDATES)
def test_each_candidate_computes_every_weights_product(name) -> None:
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(64, 96, generator=gen).bfloat16() for _ in range(3)]
    x = torch.randn(16, 96, generator=gen).bfloat16()
    try:
        run = gc.runner(name, weights, 16)
    except gc.Unavailable as e:  # this CPU lacks what the candidate needs: it says what
        pytest.skip(f"{name}: {e}")
    for got, w in zip(run(x), weights, strict=True):
        want = F.linear(x.float(), w.float())
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_a_candidate_that_cannot_run_is_recorded_and_the_others_run(tmp_path, monkeypatch) -> None:
    real = gc.runner

    def runner(name, weights, rows):
        if name == "inductor":
            raise RuntimeError("no C++ compiler")
        return real(name, weights, rows)

    monkeypatch.setattr(gc, "runner", runner)
    monkeypatch.setattr(gc, "shapes", lambda spec: {"o": (64, 128)})
    out = tmp_path / "gemm.json"
    argv = ["--candidates", "aten", "inductor", "--rows", "1", "4", "--pool-mib", "1"]
    assert gc.main([*argv, "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["rows"], r["fastest"]) for r in rows] == [
        ("o", 1, "aten"),
        ("o", 4, "aten"),
    ]
    assert all(r["inductor"] == {"error": "RuntimeError: no C++ compiler"} for r in rows)
    assert all(r["aten"]["us"] > 0 and r["weights"] == 64 for r in rows)  # 1 MiB of 16 KiB weights
    assert json.loads(out.read_text())["cpu_level"] == bf16.level()
