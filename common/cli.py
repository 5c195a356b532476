"""Command-line flags derived from a service's pydantic settings model, so each setting is declared once.

Every field `foo_bar` becomes `--foo-bar` with the field's type, choices (Literal), help (its
description, default and environment variable). Flags default to None: a flag left out falls back to
the environment (`<PREFIX>FOO_BAR`), then to the field's default, so a deployment may configure by
flags, environment or both. List fields are repeatable flags.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path

from pydantic import BaseModel, ValidationError
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
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
    flags: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of `model` (or of `only`); `flags` renames some, e.g. {"routers": "--router"}."""
    prefix = model.model_config.get("env_prefix", "")
    for name, field in model.model_fields.items():
        if name in skip or (only is not None and name not in only):
            continue
        annotation = _unwrap_optional(field.annotation)
        kwargs: dict[str, typing.Any] = {"dest": name, "default": None}
        origin = typing.get_origin(annotation)
        if origin is typing.Literal:
            choices = typing.get_args(annotation)
            kwargs.update(choices=choices, type=type(choices[0]))
        elif origin is list:
            kwargs.update(action="append", type=typing.get_args(annotation)[0])
        elif annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = annotation if annotation in (int, float, str, Path) else str
        if field.is_required():
            default = "required"
        elif field.default is PydanticUndefined or field.default in (None, ""):
            default = "default: none"
        else:
            default = f"default {field.default!r}"
        help_text = f"{field.description} ({default}; env {prefix}{name.upper()})"
        kwargs["help"] = help_text.replace("%", "%%")  # argparse formats help with %
        parser.add_argument((flags or {}).get(name, flag(name)), **kwargs)


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
    """The row of the exit-code table (README, "Exit codes") an error ends a command with: 2 when
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
