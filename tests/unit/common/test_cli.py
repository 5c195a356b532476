"""common/cli.py: flags derived from a settings model. A command's model (a plain BaseModel) gets
required flags and values checked as they are parsed; a service's (a BaseSettings) falls back to
its environment and is checked when the settings are built."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.cli import add_settings_arguments, settings_from_args
from common.errors import InvalidArgumentError


class Command(BaseModel):
    model_config = ConfigDict(extra="forbid")

    files: list[Path] = Field(description="inputs", json_schema_extra={"metavar": "FILE"})
    out: Path = Field(description="where to write")
    groups: int = Field(4, ge=1, description="how many groups")
    ports: list[int] | None = Field(None, description="ports", json_schema_extra={"nargs": "+"})
    size: str = Field("25%", description="a size")
    verbose: bool = Field(False, description="say more")
    secret: float = Field(1.0, description="", json_schema_extra={"hidden": True})

    @field_validator("size")
    @classmethod
    def _size(cls, text: str) -> str:
        if not text.endswith("%"):
            raise ValueError(f"{text!r} is not a percentage")
        return text

    @field_validator("ports")
    @classmethod
    def _ports(cls, ports: list[int] | None) -> list[int] | None:
        if ports and any(not 0 < p < 65536 for p in ports):
            raise ValueError(f"not a port in {ports}")
        return ports


class Service(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MOE_TEST_", extra="forbid")

    max_things: int = Field(8, ge=1, description="things at most")


def parser_for(model: type[BaseModel], **kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cmd")
    add_settings_arguments(p, model, **kwargs)
    return p


def command(argv: list[str]) -> Command:
    p = parser_for(Command, flags={"files": "files"})
    return settings_from_args(Command, p.parse_args(argv))  # type: ignore[return-value]


def test_a_command_gets_its_values_parsed_checked_and_its_defaults() -> None:
    got = command(["a", "b", "--out", "o", "--ports", "80", "443", "--verbose", "--groups", "2"])
    assert got == Command(
        files=[Path("a"), Path("b")], out=Path("o"), groups=2, ports=[80, 443], verbose=True
    )
    assert command(["a", "--out", "o"]) == Command(files=[Path("a")], out=Path("o"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["a"], "the following arguments are required: --out"),
        (["--out", "o"], "the following arguments are required: FILE"),
        (
            ["a", "--out", "o", "--groups", "0"],
            "argument --groups: Input should be greater than or equal to 1, got '0'",
        ),
        (
            ["a", "--out", "o", "--groups", "x"],
            "argument --groups: Input should be a valid integer",
        ),
        (["a", "--out", "o", "--size", "3"], "argument --size: '3' is not a percentage"),
        (["a", "--out", "o", "--ports", "80", "0"], "argument --ports: not a port in [0]"),
    ],
)
def test_a_bad_command_line_is_argparse_s_usage_error(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        command(argv)
    assert e.value.code == 2
    assert f"cmd: error: {message}" in capsys.readouterr().err


def test_help_names_metavars_defaults_and_hides_what_is_hidden() -> None:
    text = parser_for(Command, flags={"files": "files"}).format_help()
    assert "FILE [FILE ...]" in text and "--ports PORTS [PORTS ...]" in text
    assert "how many groups (default 4)" in text
    assert "inputs (required)" in text
    assert "--secret" not in text
    assert "env " not in text  # a command reads no environment variables


def test_a_service_falls_back_to_its_environment_and_is_checked_when_built(monkeypatch) -> None:
    assert "(default 8; env MOE_TEST_MAX_THINGS)" in parser_for(Service).format_help()
    p = parser_for(Service)
    monkeypatch.setenv("MOE_TEST_MAX_THINGS", "3")
    assert settings_from_args(Service, p.parse_args([])) == Service(max_things=3)
    assert settings_from_args(Service, p.parse_args(["--max-things", "5"])).max_things == 5
    args = p.parse_args(["--max-things", "0"])  # parsed as given: the settings check it
    with pytest.raises(InvalidArgumentError, match="--max-things: Input should be greater"):
        settings_from_args(Service, args)


def test_only_skip_and_groups_split_one_model_over_several_parsers() -> None:
    p = argparse.ArgumentParser(prog="cmd")
    add_settings_arguments(p, Command, only=["out", "groups"])
    where = p.add_mutually_exclusive_group()
    add_settings_arguments(where, Command, skip=["files", "out", "groups"])
    options = {o for a in p._actions for o in a.option_strings}
    assert {"--out", "--groups", "--ports", "--size", "--verbose"} <= options
    assert "files" not in {a.dest for a in p._actions}
    with pytest.raises(SystemExit):
        p.parse_args(["--out", "o", "--size", "1%", "--verbose"])  # one of the group at most
