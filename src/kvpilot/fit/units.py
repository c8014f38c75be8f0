"""Human-readable numbers for the tables (binary units for memory, SI for rates)."""

from __future__ import annotations


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"


def gb_and_gib(num_bytes: float) -> str:
    digits = 1 if num_bytes >= 10e9 else 3
    return f"{num_bytes / 1e9:,.{digits}f} GB ({num_bytes / 2**30:,.{digits}f} GiB)"


def count(n: float) -> str:
    """1234567 -> '1.23B', 12345 -> '12,345'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f}{suffix}"
    return f"{n:,.0f}"


def rate(per_s: float, unit: str = "tok/s") -> str:
    return f"{per_s:,.1f} {unit}" if per_s < 100 else f"{per_s:,.0f} {unit}"


def seconds(s: float) -> str:
    return f"{s * 1000:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def flops(f: float) -> str:
    return f"{f / 1e12:,.1f} TFLOP/s" if f >= 1e12 else f"{f / 1e9:,.0f} GFLOP/s"


def bandwidth(b: float) -> str:
    return f"{b / 1e12:,.2f} TB/s" if b >= 1e12 else f"{b / 1e9:,.0f} GB/s"
