"""Checks of the arguments the public client methods take, each raising
:class:`~kvstore.errors.InvalidArgument` (or :class:`~kvstore.errors.BadShape`) that names
the argument, before any I/O. Every public method runs its arguments through these, so an
engine catches only :class:`~kvstore.errors.KVStoreError` (a property test drives every
method with arbitrary arguments: ``tests/test_client_errors.py``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.core.codec import KV, kv_halves
from kvstore.errors import BadShape, InvalidArgument

from .paged import PagedCache

__all__ = [
    "MAX_SECONDS",
    "MAX_TAG_LEN",
    "device",
    "flag",
    "index",
    "kv_device",
    "nonneg_int",
    "number",
    "seconds",
    "sequence",
    "tensors",
    "text",
]

MAX_SECONDS = 7 * 24 * 3600.0
"""Longest deadline or hold accepted (a week): past it a value is a mistake."""
MAX_TAG_LEN = 1024


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def seconds(value: Any, name: str = "timeout", *, zero: bool = False) -> float:
    """``value`` as seconds: a real number, finite, > 0 (>= 0 with ``zero``), at most
    :data:`MAX_SECONDS`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} must be a number of seconds, got {type(value).__name__}")
    s = _float(value, name)
    low_ok = s >= 0 if zero else s > 0
    if not (math.isfinite(s) and low_ok and s <= MAX_SECONDS):
        bound = ">= 0" if zero else "> 0"
        raise InvalidArgument(f"{name} must be {bound} and <= {MAX_SECONDS:g} s, got {value!r}")
    return s


def number(value: Any, name: str) -> float:
    """``value`` as a finite real number >= 0 (a weight)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} must be a number, got {type(value).__name__}")
    f = _float(value, name)
    if not (math.isfinite(f) and f >= 0):
        raise InvalidArgument(f"{name} must be finite and >= 0, got {value!r}")
    return f


def _float(value: Any, name: str) -> float:
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        raise InvalidArgument(f"{name} {value!r} is not a representable number") from None


def index(value: Any, name: str, upper: int) -> int:
    """``value`` as an int in ``[0, upper)``."""
    if not _is_int(value):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= int(value) < upper:
        raise InvalidArgument(f"{name} {value} outside [0, {upper})")
    return int(value)


def nonneg_int(value: Any, name: str, upper: int = 2**63) -> int:
    """``value`` as an int in ``[0, upper)``."""
    if not _is_int(value) or not 0 <= int(value) < upper:
        raise InvalidArgument(f"{name} must be an int in [0, {upper}), got {value!r}")
    return int(value)


def positive_int(value: Any, name: str, upper: int = 2**63) -> int:
    """``value`` as an int in ``[1, upper)``."""
    if not _is_int(value) or not 1 <= int(value) < upper:
        raise InvalidArgument(f"{name} must be an int in [1, {upper}), got {value!r}")
    return int(value)


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool (a bool, nothing else)."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a bool, got {type(value).__name__}")
    return value


def text(value: Any, name: str, max_bytes: int = MAX_TAG_LEN, *, empty: bool = True) -> str:
    """``value`` as a str that UTF-8 encodes (no lone surrogates) to at most ``max_bytes``."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a str, got {type(value).__name__}")
    try:
        n = len(value.encode())
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{name} is not valid UTF-8 text: {exc.reason}") from None
    if n > max_bytes or (not empty and n == 0):
        least = "" if empty else "non-empty, "
        raise InvalidArgument(f"{name} must be {least}at most {max_bytes} bytes, got {n}")
    return value


def kv_device(t: KV) -> torch.device:
    """The device a ``[2, T, H, D]`` layer tensor or a (K, V) pair lives on."""
    return kv_halves(t)[0].device


def device(value: Any, name: str = "device") -> torch.device | None:
    """``value`` as a torch device results may be made on: None (CPU), the CPU, or a CUDA
    device this process has."""
    if value is None:
        return None
    if _is_int(value):  # a CUDA ordinal, as torch.cuda.current_device() gives
        value = f"cuda:{int(value)}" if int(value) >= 0 else "invalid"
    if not isinstance(value, str | torch.device) or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a torch.device or its name, got {value!r}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"{name} {value!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return dev
    present = torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    if dev.type == "cuda" and present:
        return dev
    raise InvalidArgument(f"{name} {value!r}: results go to the CPU or a CUDA device present")


def sequence(value: Any, name: str) -> list[Any]:
    """``value`` as a list (a sequence, not a tensor or a string)."""
    if isinstance(value, torch.Tensor | str | bytes) or not isinstance(value, Sequence):
        raise BadShape(f"{name} must be a sequence, got {type(value).__name__}")
    return list(value)


def tensors(value: Any, name: str) -> list[Any]:
    """``value`` as a list of tensors or :class:`~kvclient.paged.PagedCache` objects (one
    per layer: an engine's caches)."""
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        raise BadShape(f"{name} must be a sequence of tensors, got {type(value).__name__}")
    out = list(value)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor | PagedCache):
            raise BadShape(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return out
