"""A slice's profile extended to the whole model (moe_mesh/planning/extend.py), through `moe-mesh
sizing CONFIG --extend-profile`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from common.arch import parse_spec
from moe_mesh.planning import sizing
from moe_mesh.planning.geometries import MIXTRAL_8X7B
from moe_mesh.planning.profile_format import read_profile
from tests.support.plans import fit, measured, write_profile

EXPERT = 3 * 4096 * 14336  # Mixtral-8x7B's expert parameters


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moe-mesh")
    sizing.add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def slice_profile(tmp_path: Path, **overrides) -> Path:
    """A profile of a 2-layer Mixtral-8x7B slice in bfloat16 with a vocabulary of 8,192."""
    ckpt = tmp_path / "slice"
    ckpt.mkdir()
    config = {**MIXTRAL_8X7B, "num_hidden_layers": 2, "vocab_size": 8192}
    (ckpt / "config.json").write_text(json.dumps(config))
    raw = {
        "checkpoint": str(ckpt),
        "dtype": "bfloat16",
        "hidden_size": 4096,
        "expert_bytes": EXPERT * 2,
        "head": measured(fit(1e-3, 2e-3), threads=2),
        "expert_load_shares": {"0": [0.5] + [0.5 / 7] * 7, "1": [1 / 8] * 8},
        **overrides,
    }
    return write_profile(tmp_path, **raw)


def test_the_slice_becomes_the_whole_model(tmp_path: Path) -> None:
    out = tmp_path / "full.json"
    assert (
        run(
            [
                "sizing",
                "mixtral-8x7b",
                "--extend-profile",
                str(slice_profile(tmp_path)),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    full, spec = read_profile(out), parse_spec(MIXTRAL_8X7B)
    assert (full.model_id, full.num_layers, full.moe_layers) == (
        "mixtral-8x7b",
        32,
        list(range(32)),
    )
    assert full.dense_bytes == sizing.dense_params(spec) * 2
    assert full.expert_load_shares["2"] == full.expert_load_shares["0"]  # the slice's, cyclically
    assert full.expert_load_shares["3"] == [1 / 8] * 8
    # The head reads a vocabulary 32000 / 8192 times larger.
    assert full.head.wall.slope == pytest.approx(1e-3 * 32000 / 8192)
    assert full.head.points[0].wall_s == pytest.approx(3e-3 * 32000 / 8192)
    assert full.ta == read_profile(tmp_path / "profile.json").ta  # a layer costs what it did


def test_a_slice_of_another_shape_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = slice_profile(tmp_path, expert_bytes=EXPERT * 4)  # float32 bytes in a bfloat16 profile
    assert (
        run(["sizing", "mixtral-8x7b", "--extend-profile", str(path), "--out", str(tmp_path / "x")])
        == 2
    )
    assert "expert_bytes: the profile's slice has" in capsys.readouterr().err
    assert run(["sizing", "mixtral-8x7b", "--extend-profile", str(path)]) == 2
    assert "--extend-profile and --out go together" in capsys.readouterr().err
