"""Byte sizes as people write them (``"512MiB"``, ``"4G"``, ``"100MB"``) and back.

Torch-free and dependency-free, so the command line can validate sizes before importing
anything heavy (:mod:`kvstore.config`) and the arena can take them from its callers.
"""

from __future__ import annotations

import re
from fractions import Fraction

from kvstore.errors import InvalidArgument

__all__ = ["format_size", "parse_size"]

_UNITS = {
    **dict.fromkeys(("", "b"), 1),
    **{u: 1 << 10 for u in ("k", "ki", "kib")},
    **{u: 1 << 20 for u in ("m", "mi", "mib")},
    **{u: 1 << 30 for u in ("g", "gi", "gib")},
    **{u: 1 << 40 for u in ("t", "ti", "tib")},
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(text: object) -> int:
    """Parse a byte size: ``"512MiB"``, ``"4GiB"``, ``"1G"``, ``"100MB"``, ``"4096"``, ``"1.5GiB"``.

    Binary suffixes (``KiB MiB GiB TiB``, also ``Ki Mi Gi Ti``) and bare letters (``K M G T``,
    as docker and ``--host-mem 4G`` users mean them) are powers of 1024; ``KB MB GB TB`` are
    powers of 1000; ``B`` or nothing is bytes. Units are case-insensitive, whitespace around
    them is allowed, fractions are exact and must come out to a whole number of bytes. An
    ``int`` is returned as is. Pure; raises :class:`InvalidArgument` on anything else
    (negative, empty, unknown unit, fractional bytes, ``bool``).
    """
    if isinstance(text, bool):
        raise InvalidArgument(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise InvalidArgument(f"size must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise InvalidArgument(f"size must be a string or int, got {type(text).__name__}")
    match = _SIZE_RE.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise InvalidArgument(f"not a size: {text!r} (examples: 4096, 512MiB, 4GiB, 1G, 100MB)")
    value = Fraction(match.group(1)) * unit
    if value.denominator != 1:
        raise InvalidArgument(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it: 536870912 -> ``"512MiB"``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
