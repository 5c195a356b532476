"""Shared by the operator views: plain-text tables and HOST:PORT arguments."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart, each as wide as its widest cell."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    return "\n".join(
        "  ".join(f"{c:<{w}}" for c, w in zip(line, widths)).rstrip() for line in [header, *rows]
    )


def address(text: str) -> str:
    """`text` when it is HOST:PORT, else ValueError."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return text


HostPort = Annotated[str, AfterValidator(address)]  # a settings field holding HOST:PORT
