"""The two chunk checksums of :mod:`kvstore.core.codec`, over uint8 rows on any device.

* ``xxh3_64`` (the ``xxhash`` package): the default for host buffers, ~13 GB/s. It reads a
  CPU row in place through numpy (no ``bytes`` copy); a device row is copied to the host
  first, which the caller counts.
* ``mulsum64``: the default on every other device, computed there with torch ops. The
  covered bytes as little-endian int64 words ``w_i``; the checksum is
  ``sum(w_i · m_i) mod 2**64`` with odd per-position multipliers
  ``m_i = splitmix64 output (i + 1) | 1``. A flipped bit k of word i changes the sum by
  ``±2**k · m_i``, never 0 mod 2**64, so every one-bit error is caught; the per-position
  multipliers catch swapped words. Blind spot: bit k flipped in two words changes it by
  ``2**k · (±m_i ± m_j)``, which vanishes for k = 63 always (``m_i ± m_j`` is even) and
  with probability ``2**(k-63)`` below (docs/codec.md, Checksums).

No I/O; the writers fill the rows they are given in place. Nothing blocks beyond the
computation, except that a device checksum read on the host waits for its kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch
import xxhash
from torch import Tensor

__all__ = [
    "OnCopy",
    "compute_checksum",
    "mulsum64",
    "stored_checksum",
    "write_checksums",
    "write_xxh3",
    "xxh3_64",
]

OnCopy = Callable[[int], None]
"""Called with the size of each host copy that xxh3 of a device buffer makes."""


@lru_cache(maxsize=8)
def _multipliers(nwords: int, device: torch.device) -> Tensor:
    """``mix64((i + 1) * 0x9E3779B97F4A7C15) | 1`` for i < nwords (splitmix64's outputs),
    as int64 with two's complement wrap-around; ``>>`` is masked to act as a logical shift.
    """
    z = torch.arange(1, nwords + 1, dtype=torch.int64, device=device)
    z = z * -7046029254386353131  # 0x9E3779B97F4A7C15
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return z | 1


def mulsum64(rows: Tensor, *, generic: bool = False) -> Tensor:
    """Device checksum of each row of ``rows [N, L]`` (uint8, L % 8 == 0) -> int64 ``[N]``.

    Runs where ``rows`` lives, asynchronously on a GPU. Addition and multiplication wrap
    modulo 2**64 in every kernel, so the order of the sum does not matter: on CPU ``mv``
    (2.5x faster there) and elsewhere ``mul`` + ``sum`` give identical bits
    (``generic=True`` forces the latter; tests compare the two). Raises nothing of its own.
    """
    words = rows.view(torch.int64)
    mult = _multipliers(words.shape[1], words.device)
    if words.device.type == "cpu" and not generic:
        return torch.mv(words, mult)
    return (words * mult).sum(dim=1)


def xxh3_64(row: np.ndarray | Tensor) -> int:
    """xxh3_64 of a contiguous 1-D uint8 host array or CPU tensor, read in place."""
    data = row.numpy() if isinstance(row, Tensor) else row
    return xxhash.xxh3_64_intdigest(data.data)


def write_xxh3(rows: np.ndarray, end: int, first: int, stop: int) -> None:
    """Store xxh3_64 of ``rows[r, :end]`` little-endian at ``rows[r, end:end + 8]`` for
    ``first <= r < stop`` (``rows``: a host uint8 array, rows and ``end`` 8-aligned)."""
    slots = rows[first:stop, end : end + 8].view("<u8")[:, 0]
    for i, r in enumerate(range(first, stop)):
        slots[i] = xxhash.xxh3_64_intdigest(rows[r, :end].data)


def _device_xxh3(row: Tensor, on_copy: OnCopy) -> int:
    if row.device.type != "cpu":
        on_copy(row.numel())
        row = row.cpu()
    return xxh3_64(row)


def write_checksums(rows: Tensor, end: int, kind: str, on_copy: OnCopy) -> None:
    """Store the ``kind`` checksum of each ``rows[i, :end]`` little-endian at
    ``rows[i, end:end + 8]`` (``rows``: uint8 ``[N, L]`` on any device, 8-aligned)."""
    if kind == "mulsum64":
        rows[:, end : end + 8].view(torch.int64).squeeze(1).copy_(mulsum64(rows[:, :end]))
        return
    digests = [_device_xxh3(row, on_copy) for row in rows[:, :end]]
    packed = np.array(digests, dtype="<u8").view(np.uint8).reshape(-1, 8)
    rows[:, end : end + 8].copy_(torch.from_numpy(packed))


def stored_checksum(buf: Tensor, end: int, host: np.ndarray | None) -> int:
    """The checksum stored at ``buf[end:end + 8]`` (``host``: ``buf``'s numpy view, if any)."""
    if host is not None:
        return int(host[end : end + 8].view("<u8")[0])
    return int.from_bytes(buf[end : end + 8].cpu().numpy().tobytes(), "little")


def compute_checksum(
    buf: Tensor, end: int, kind: str, host: np.ndarray | None, on_copy: OnCopy
) -> int:
    """The ``kind`` checksum of ``buf[:end]``, computed where it lives (mulsum64) or on
    the host (xxh3: in place through ``host`` if given, else after a counted copy).
    Blocks until the value is on the host."""
    if kind == "mulsum64":
        return int(mulsum64(buf[:end].unsqueeze(0))[0].item()) % 2**64
    return xxh3_64(host[:end]) if host is not None else _device_xxh3(buf[:end], on_copy)
