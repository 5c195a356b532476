"""Byte sizes as people write them: `512MiB`, `2GB`, `1048576`, or a share of a whole like `25%`."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*|%)\s*")


def parse_size(text: str, whole: int | None = None) -> int:
    """Bytes in `text`; a percentage is of `whole`. Raises ValueError saying what is accepted."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or (unit != "%" and unit not in _UNITS):
        raise ValueError(
            f"{text!r} is not a size: use bytes (1048576), a unit (512MiB, 2GB) or a percentage (25%)"
        )
    value = float(m.group(1))
    if unit == "%":
        if whole is None:
            raise ValueError(f"{text!r}: a percentage needs a whole to be a share of")
        if value > 100:
            raise ValueError(f"{text!r}: a percentage is at most 100%")
        return int(whole * value / 100)
    return int(value * _UNITS[unit])
