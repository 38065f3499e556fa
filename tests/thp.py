"""The kernel's transparent huge pages, as tests see them: whether this process can have
them, and what ``/proc`` says of a tensor's memory."""

from __future__ import annotations

import ctypes
import sys

import torch

_PR_GET_THP_DISABLE = 42


def mode() -> str:
    """The kernel's mode (``always``, ``madvise``, ``never``; ``""`` where it has none)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


def usable() -> bool:
    """Whether advised memory of this process can get huge pages: the kernel has them, not
    ``never``, and the process did not turn them off (``prctl(PR_SET_THP_DISABLE)``, as some
    container runtimes and services do)."""
    if not sys.platform.startswith("linux") or mode() not in ("always", "madvise"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0) == 0)


def smaps_field(t: torch.Tensor, name: str) -> int | None:
    """``name`` (``THPeligible``, ``AnonHugePages`` in kB...) of the mapping holding ``t``'s
    first byte, from /proc/self/smaps; None where the kernel does not report it."""
    at, inside = t.data_ptr(), False
    with open("/proc/self/smaps", errors="replace") as f:
        for line in f:
            head, *rest = line.split()
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= at < hi
            elif inside and head == name + ":":
                return int(rest[0])
    return None


def fallbacks() -> int:
    """Times the kernel wanted a huge page at a fault and took 4 KiB pages instead (no free
    2 MiB page, or a cgroup's limit), from /proc/vmstat; 0 where it does not count them."""
    total = 0
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in ("thp_fault_fallback", "thp_fault_fallback_charge"):
                    total += int(value)
    except (OSError, ValueError):
        return 0
    return total
