"""The `moe-mesh` parser: a known command builds only its own, and parses as the whole one does; a
broken ready file is one line and exit 2 for every command that reads one."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from moe_mesh.cli import _COMMANDS, build_parser, main


def _commands(parser) -> list[str]:
    return list(parser._subparsers._group_actions[0].choices)


def test_a_command_builds_only_its_parser_and_parses_like_the_whole_one() -> None:
    assert _commands(build_parser()) == list(_COMMANDS)  # --help lists every command, in order
    assert _commands(build_parser("status")) == ["status"]
    assert _commands(build_parser("up")) == ["up", "scale"]  # siblings come with their module
    assert _commands(build_parser("no-such-command")) == list(_COMMANDS)  # argparse names them all
    argv = ["trace", "show", "a.jsonl", "--list"]
    assert vars(build_parser("trace").parse_args(argv)) == vars(build_parser().parse_args(argv))


def test_status_imports_no_other_commands_module() -> None:
    probe = (
        "import sys; from moe_mesh.cli import build_parser; build_parser('status'); "
        "print(sorted(m for m in sys.modules if m.startswith(('moe_mesh.benchmark', "
        "'moe_mesh.planning', 'moe_mesh.local.launcher'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("garbage", "(not JSON)"),
        ("", "(not JSON)"),
        ("[1]", "(not a JSON object)"),
        ('{"pids": {}}', "is not a ready file of `moe-mesh up` (no "),
        (None, "cannot be read: Is a directory"),
    ],
)
@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["scale", "--experts", "0:0", "--replicas", "1"],
        ["placement", "show"],
        ["stats"],
        ["bench"],
        ["generate", "--prompt", "hi"],
    ],
)
def test_every_command_refuses_a_broken_ready_file_in_one_line_with_exit_2(
    argv, content, why, tmp_path, capsys
) -> None:
    path = tmp_path / "mesh.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    assert main([*argv, "--ready-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-mesh {argv[0]}") and "--ready-file" in err and why in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["status", "--ready-file", "x", "--jsn"], "unrecognized arguments: --jsn; --jsn: did you mean --json?"),
        (["up", "--checkpont", "x"], "unrecognized arguments: --checkpont x; --checkpont: did you mean --checkpoint?"),
        (["status", "--ready-file", "x", "--bogus"], "unrecognized arguments: --bogus\n"),
    ],
)  # fmt: skip
def test_a_mistyped_flag_is_reported_by_its_command_with_the_flag_it_is_closest_to(
    argv, said, capsys
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: moe-mesh {argv[0]} "), err
    assert err.endswith(
        f"moe-mesh {argv[0]}: error: {said}" + ("" if said.endswith("\n") else "\n")
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["serve-expert", "--experts", "*:0"],
        ["serve-router"],
        ["generate", "--local", "--prompt", "x"],
    ],
)
def test_a_wrong_checkpoint_is_refused_before_torch_is_imported(argv, tmp_path) -> None:
    probe = (
        "import sys; from moe_mesh.cli import main; "
        f"code = main({[*argv, '--checkpoint', str(tmp_path / 'nope')]!r}); "
        "print(code, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert "checkpoint directory not found" in out.stderr, out.stderr


def test_a_bad_max_isa_is_refused_before_a_command_that_computes_runs(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MOE_MESH_MAX_ISA", "avx-512")
    assert main(["up", "--checkpoint", str(tmp_path / "nope")]) == 2  # before the checkpoint
    said = "MOE_MESH_MAX_ISA: 'avx-512' is not one of none, avx2, avx512, all"
    assert said in capsys.readouterr().err
    assert main(["status", "--ready-file", str(tmp_path / "mesh.json")]) == 2  # not its business
    assert "MOE_MESH_MAX_ISA" not in (err := capsys.readouterr().err) and "mesh.json" in err


def test_status_takes_a_ready_file_or_a_gateway_and_says_so(tmp_path, capsys) -> None:
    assert main(["status"]) == 2
    assert (
        "--ready-file FILE (a mesh `moe-mesh up` started) or --gateway" in capsys.readouterr().err
    )
    assert main(["status", "--ready-file", str(tmp_path / "m.json"), "--gateway", "h:1"]) == 2
    assert "not both or neither" in capsys.readouterr().err


def test_status_of_a_hand_built_mesh_names_a_registry_it_cannot_read(capsys) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["status", "--gateway", "127.0.0.1:1", "--registry-address", f"127.0.0.1:{port}"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"registry http://127.0.0.1:{port} unreachable" in err and "Traceback" not in err
