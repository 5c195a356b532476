"""Command-line flags derived from a pydantic settings model, so each setting is declared once: a
service's (a BaseSettings) or a command's (a plain BaseModel).

Every field `foo_bar` becomes `--foo-bar` with the field's type, choices (Literal), help (its
description, default and, for a service, environment variable). A service's flags default to None:
a flag left out falls back to the environment (`<PREFIX>FOO_BAR`), then to the field's default, so
a deployment may configure by flags, environment or both. A command's flags are checked by the
field's own validation as they are parsed. List fields are repeatable flags.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from common import errors
from common.errors import InvalidArgumentError


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: typing.Any) -> typing.Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_settings_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
    flags: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of `model` (or of `only`); `flags` renames some, e.g. {"routers": "--router"}
    (a name without dashes makes a positional argument). `parser` may be an argument group.

    A service's model is a BaseSettings: a flag left out falls back to its environment variable, so
    its values are checked when the settings are built. A command's model is a plain BaseModel: its
    required fields are required flags and each value is checked as it is parsed, so a bad one is
    argparse's usage error naming the flag. A field's json_schema_extra may name its value in --help
    (`{"metavar": "FILE"}`) or hide the flag (`{"hidden": True}`).
    """
    # A BaseSettings model always has an env_prefix (tested without importing pydantic_settings,
    # which `moe-mesh probe`, a container health check, would pay for on every run).
    service = "env_prefix" in model.model_config
    prefix = model.model_config.get("env_prefix", "")
    for name, field in model.model_fields.items():
        if name in skip or (only is not None and name not in only):
            continue
        option = (flags or {}).get(name, flag(name))
        kwargs = _flag_kwargs(model, name, field, checked=not service)
        if not option.startswith("-"):  # positional: argparse takes its name as the dest
            del kwargs["dest"]
            kwargs.pop("required", None)
            if kwargs.pop("action", None) == "append":
                kwargs["nargs"] = "+" if field.is_required() else "*"
        if field.is_required():
            default = "required"
        elif field.default is PydanticUndefined or field.default in (None, ""):
            default = "default: none"
        elif isinstance(field.default, tuple):
            default = "default " + ",".join(map(str, field.default))
        else:
            default = f"default {field.default!r}"
        env = f"; env {prefix}{name.upper()}" if service else ""
        help_text = f"{field.description} ({default}{env})".replace("%", "%%")  # argparse's %
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        kwargs["help"] = argparse.SUPPRESS if extra.get("hidden") else help_text
        parser.add_argument(option, **kwargs)


def _flag_kwargs(
    model: type[BaseModel], name: str, field: FieldInfo, *, checked: bool
) -> dict[str, typing.Any]:
    annotation = _unwrap_optional(field.annotation)
    kwargs: dict[str, typing.Any] = {"dest": name, "default": None}
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "metavar" in extra:
        kwargs["metavar"] = extra["metavar"]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        kwargs.update(choices=choices, type=type(choices[0]))
    elif origin is list:
        item = typing.get_args(annotation)[0]
        kwargs["type"] = _field_parser(model, name, item=True) if checked else item
        if "nargs" in extra:  # `--experts A B` rather than `--experts A --experts B`
            kwargs["nargs"] = extra["nargs"]
        else:
            kwargs["action"] = "append"
    elif annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif checked:
        kwargs["type"] = _field_parser(model, name)
    else:
        kwargs["type"] = annotation if annotation in (int, float, str, Path) else str
    if checked and field.is_required():
        kwargs["required"] = True
    return kwargs


def _field_parser(
    model: type[BaseModel], name: str, *, item: bool = False
) -> typing.Callable[[str], typing.Any]:
    """argparse's `type` for one field (one `item` of a list field): the text through the field's
    own validation (bounds, validators), so '--groups 0' fails with the field's message."""

    def parse(text: str) -> typing.Any:
        try:
            checked = model.__pydantic_validator__.validate_assignment(
                model.model_construct(), name, [text] if item else text
            )
        except ValidationError as e:
            error = e.errors()[0]
            if error["type"] == "value_error":  # the field's own validator, which names the value
                raise argparse.ArgumentTypeError(
                    error["msg"].removeprefix("Value error, ")
                ) from None
            raise argparse.ArgumentTypeError(f"{error['msg']}, got {text!r}") from None
        value = getattr(checked, name)
        return value[0] if item else value

    return parse


def settings_from_args(
    model: type[BaseModel],
    args: argparse.Namespace,
    *,
    required: Collection[str] = (),
    flags: Mapping[str, str] | None = None,
) -> BaseModel:
    """The settings from the flags given (others from the environment and defaults).

    Raises InvalidArgumentError with one line naming the flags, e.g.
    '--max-batch-tokens: Input should be greater than or equal to 1'.
    """
    given = {name: v for name in model.model_fields if (v := getattr(args, name, None)) is not None}
    names = flags or {}
    try:
        settings = model(**given)
    except ValidationError as e:
        problems = [
            (
                names.get(str(err["loc"][0]), flag(str(err["loc"][0])))
                if err["loc"]
                else "settings",
                err["msg"].removeprefix("Value error, "),  # our validators' own message
            )
            for err in e.errors()
        ]
        raise _one_line(problems) from None
    prefix = model.model_config.get("env_prefix", "")
    missing = [
        (names.get(n, flag(n)), f"required (or {prefix}{n.upper()})")
        for n in required
        if getattr(settings, n) is None
    ]
    if missing:
        raise _one_line(missing)
    return settings


def _one_line(problems: list[tuple[str, str]]) -> InvalidArgumentError:
    (first, message), rest = problems[0], problems[1:]
    return InvalidArgumentError(first, "; ".join([message, *(f"{f}: {m}" for f, m in rest)]))


EXIT_FAILED, EXIT_USAGE = 1, 2


def exit_code(e: BaseException) -> int:
    """The row of the exit-code table (docs/reference/exit-codes.md) an error ends a command with: 2 when
    the command was wrong (a bad value, a missing or broken checkpoint, an unknown name), 1 when the
    mesh or the machine failed (a peer unreachable, a port taken, a service died)."""
    usage = (
        errors.InvalidArgumentError,
        errors.CheckpointError,
        errors.NotFoundError,
        errors.PreconditionError,  # services of different checkpoints pointed at each other
        errors.UnauthenticatedError,  # no API key, or a wrong one
    )
    return EXIT_USAGE if isinstance(e, usage) else EXIT_FAILED
