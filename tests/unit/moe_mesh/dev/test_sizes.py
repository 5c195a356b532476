"""moe_mesh/dev/sizes.py finds long functions and files in a planted tree, skips tests and generated
code, honours the opt-out marker only with a reason, and exits 1 when it finds any."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_mesh.dev import sizes


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def _plant(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_finds_long_functions_methods_and_files_with_their_line_counts(tmp_path) -> None:
    _plant(tmp_path, "pkg/a.py", _function("short", 79) + _function("long", 80))
    method = "class C:\n" + _function("m", 81, indent="    ")
    _plant(tmp_path, "pkg/b.py", method)
    _plant(tmp_path, "pkg/big.py", "x = 1\n" * 501)
    _plant(tmp_path, "pkg/edge.py", "x = 1\n" * 500)
    found = sizes.find(tmp_path, sizes.SizesSettings())
    assert [str(t) for t in found] == [
        "pkg/a.py: function long: 81 lines",
        "pkg/b.py: function C.m: 82 lines",
        "pkg/big.py: file: 501 lines",
    ]


def test_nested_functions_are_named_by_their_path(tmp_path) -> None:
    inner = _function("inner", 10, indent="    ")
    _plant(tmp_path, "n.py", "def outer():\n" + inner)
    found = sizes.find(tmp_path, sizes.SizesSettings(max_function_lines=5))
    assert [(t.name, t.lines) for t in found] == [("outer", 12), ("outer.inner", 11)]


def test_tests_generated_code_and_build_outputs_are_skipped(tmp_path) -> None:
    long = _function("f", 100)
    for rel in ("tests/unit/test_x.py", "protos/v1/x_pb2.py", "protos/v1/x_pb2_grpc.py"):
        _plant(tmp_path, rel, long)
    for rel in ("build/lib/x.py", ".venv/lib/y.py", "node_modules/z.py"):
        _plant(tmp_path, rel, long)
    _plant(tmp_path, "pkg/x_pb2_helper.py", long)  # not generated: only *_pb2.py / *_pb2_grpc.py
    assert [t.path for t in sizes.find(tmp_path, sizes.SizesSettings())] == ["pkg/x_pb2_helper.py"]


def test_a_data_table_opts_out_of_the_file_bound_only_with_a_reason(tmp_path) -> None:
    table = "x = 1\n" * 600
    _plant(tmp_path, "reasoned.py", "# sizes: long file: the token table\n" + table)
    _plant(tmp_path, "bare.py", "# sizes: long file:\n" + table)
    _plant(tmp_path, "funcs.py", "# sizes: long file: a table\n" + table + _function("f", 90))
    found = sizes.find(tmp_path, sizes.SizesSettings())
    assert [str(t) for t in found] == [
        "bare.py: file: 601 lines",
        "funcs.py: function f: 91 lines",  # the marker exempts the file, never its functions
    ]


def test_main_prints_the_list_and_exits_1_only_when_something_is_too_long(tmp_path, capsys) -> None:
    _plant(tmp_path, "m.py", _function("f", 20))
    assert sizes.main(["--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""
    assert sizes.main(["--root", str(tmp_path), "--max-function-lines", "20"]) == 1
    assert capsys.readouterr().out == "m.py: function f: 21 lines\n"
    assert sizes.main(["--root", str(tmp_path), "--max-file-lines", "20"]) == 1
    assert capsys.readouterr().out == "m.py: file: 21 lines\n"


def test_flags_come_from_the_settings_model_and_are_validated(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        sizes.main(["--max-function-lines", "0"])
    assert e.value.code == 2
    assert "--max-function-lines" in capsys.readouterr().err
    assert sizes.SizesSettings().max_function_lines == 80
    assert sizes.SizesSettings().max_file_lines == 500


def test_the_checkout_keeps_within_the_bounds() -> None:
    found = sizes.find(sizes.ROOT, sizes.SizesSettings())
    assert not found, "over the bounds (python -m moe_mesh.dev.sizes):\n" + "\n".join(
        map(str, found)
    )
