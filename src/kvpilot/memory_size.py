"""Parses memory sizes like "4GiB", "512MiB", "2GB" or plain byte counts."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory_size(value: int | float | str, name: str = "memory size") -> int:
    """Bytes from an int or a string with a unit (decimal kB/MB/GB or binary KiB/MiB/GiB); ValueError if bad."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a string like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _PATTERN.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} {value!r} is not a size: use bytes or a number with a unit such as "
                             "512MiB, 4GiB or 2GB")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


def format_bytes(num_bytes: float) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= factor:
            return f"{num_bytes / factor:.2f} {unit}"
    return f"{int(num_bytes)} B"
