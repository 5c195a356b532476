"""`moe-mesh sizing`: bytes per expert and precision, the router's dense weights and KV cache, checked
against values computed by hand from the published config.json files and the published parameter
counts, and against the layouts the expert services pack (common/quant.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from common.arch import parse_spec
from common.quant import Quantization
from moe_mesh.planning import sizing
from moe_mesh.planning.geometries import DEEPSEEK_V3, GEOMETRIES, MIXTRAL_8X7B, QWEN3_30B_A3B
from tests.support import REPO

HIDDEN, INTER = 4096, 14336  # Mixtral-8x7B: hidden, expert intermediate
WEIGHTS = 3 * HIDDEN * INTER  # one expert's gate, up and down


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moe-mesh")
    sizing.add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_mixtral_8x7b_by_hand() -> None:
    s = sizing.sizing(parse_spec(MIXTRAL_8X7B), "mixtral-8x7b", groups=8)
    assert s.expert == {
        "bfloat16": WEIGHTS * 2,  # 352,321,536
        "int8": WEIGHTS + (2 * INTER + HIDDEN) * 4,  # a float32 scale per output row
        "int4-g64": WEIGHTS // 2 + WEIGHTS // 64 * 2,  # a bfloat16 scale per 64 inputs
        "fp8": WEIGHTS
        + 3 * (HIDDEN * INTER // (32 * 128)) * 4,  # a float32 per panel of 32 x 128 inputs
    }
    assert s.expert["int4-g64"] == 93_585_408 and s.expert["fp8"] == 176_332_800
    assert (s.moe_layers, s.experts_per_layer, s.experts_per_group) == (32, 8, 32)
    assert s.all_experts["bfloat16"] == 256 * WEIGHTS * 2
    assert s.group["int8"] == 32 * s.expert["int8"]
    # Published: 46,702,792,704 parameters, of which the routed experts are 32 x 8 x WEIGHTS.
    assert s.router_dense == (46_702_792_704 - 256 * WEIGHTS) * 2
    assert s.kv_per_1k_tokens == 32 * 8 * (128 + 128) * 2 * 1000  # layers, kv heads, k + v, bf16


def test_qwen3_30b_a3b_by_hand() -> None:
    s = sizing.sizing(parse_spec(QWEN3_30B_A3B), "qwen3-30b-a3b", groups=4)
    weights = 3 * 2048 * 768
    assert s.expert["bfloat16"] == weights * 2 == 9 * 2**20
    assert (s.moe_layers, s.experts_per_layer, s.experts_per_group) == (48, 128, 48 * 128 // 4)
    # Published: 30,532,122,624 parameters.
    assert s.router_dense == (30_532_122_624 - 48 * 128 * weights) * 2
    assert s.kv_per_1k_tokens == 48 * 4 * (128 + 128) * 2 * 1000


def test_deepseek_v3_caches_the_latent() -> None:
    s = sizing.sizing(parse_spec(DEEPSEEK_V3), "deepseek-v3", groups=8)
    # MLA caches the normalised latent (512) and the rotated rope key (64), one head, every layer.
    assert s.kv_per_1k_tokens == 61 * (512 + 64) * 2 * 1000
    assert s.moe_layers == 58 and s.experts_per_layer == 256
    assert s.expert["bfloat16"] == 3 * 7168 * 2048 * 2
    # The FP8 checkpoint's own blocks: 128 inputs, as the default.
    assert s.expert["fp8"] == 3 * 7168 * 2048 + 3 * (7168 * 2048 // (32 * 128)) * 4
    # About 671B parameters in all (the multi-token-prediction layer is not served).
    total = s.router_dense // 2 + 58 * 256 * 3 * 7168 * 2048
    assert 670e9 < total < 672e9


@pytest.mark.parametrize(
    "precision, q", [("int8", Quantization("int8")), ("int4-g64", Quantization("int4", 64))]
)
def test_bytes_follow_what_the_services_pack(precision: str, q: Quantization) -> None:
    spec = parse_spec(MIXTRAL_8X7B)
    packed = 0
    for shape in (
        (INTER, HIDDEN),
        (INTER, HIDDEN),
        (HIDDEN, INTER),
    ):  # gate, up [inter, hidden]; down [hidden, inter]
        for elements, dtype in q.layout(shape).values():
            packed += elements * dtype.itemsize
    assert sizing.expert_bytes(spec, precision) == packed


def test_fp8_bytes_follow_the_packed_layout() -> None:
    q = Quantization("fp8", 128)
    packed = sum(
        n * dtype.itemsize
        for shape in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
        for n, dtype in q.layout(shape).values()
    )
    assert sizing.expert_bytes(parse_spec(MIXTRAL_8X7B), "fp8") == packed


def test_the_command_reads_a_config_json_a_directory_or_a_name(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    assert run(["sizing", str(tmp_path / "mine"), "--json"]) == 0
    by_dir = json.loads(capsys.readouterr().out)
    assert by_dir["name"] == "mine" and by_dir["expert"]["bfloat16"] == WEIGHTS * 2
    assert run(["sizing", str(tmp_path / "mine" / "config.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_dir
    assert run(["sizing", "mixtral-8x7b"]) == 0
    table = capsys.readouterr().out
    assert "| one expert | 336 MiB | 168 MiB | 168 MiB | 89.2 MiB |" in table
    assert "KV cache 125 MiB per 1,000 tokens" in table


def test_bad_configs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run(["sizing", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    broken = dict(MIXTRAL_8X7B)
    del broken["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(broken))
    assert run(["sizing", str(tmp_path)]) == 2
    assert "hidden_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["sizing", "mixtral-8x7b", "--groups", "0"])


def test_the_sizing_page_holds_what_the_command_prints() -> None:
    page = (REPO / "docs" / "operating" / "sizing.md").read_text()
    for name, config in GEOMETRIES.items():
        assert sizing.render(sizing.sizing(parse_spec(config), name, 8)) in page, name
