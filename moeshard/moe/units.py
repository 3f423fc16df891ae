"""Byte sizes as people write them: the one parser (`--ram 8G`) and the one formatter."""

from __future__ import annotations

import re

from moeshard.moe.errors import MoeshardError


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5g', '4096' (bytes) -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)[iI]?[bB]?\s*", str(text))
    if not m:
        raise MoeshardError(f"not a size: {text!r} (use e.g. 8G, 512M)")
    unit = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * unit)


def fmt_bytes(n: float) -> str:
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}iB"
    return f"{int(n)} B"
