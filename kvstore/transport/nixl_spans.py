"""NIXL descriptors: spans of registered memory, registrations, and the checks that pair a
call's local and remote spans into descriptor rows before NIXL sees them (see
:mod:`kvstore.transport.nixl`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvstore.errors import InvalidArgument, ProtocolError

__all__ = [
    "MAX_DESCRIPTORS",
    "MEM_KINDS",
    "Groups",
    "Registration",
    "Row",
    "Span",
    "local_row",
    "pair_up",
    "remote_row",
    "remote_span",
    "tensor_region",
]

MEM_KINDS: tuple[str, ...] = ("DRAM", "VRAM")
"""Memory kinds, indexed by their wire code (0 = host memory, 1 = CUDA memory)."""

MAX_DESCRIPTORS = 65_536
"""Most span pairs one read or write may carry."""

Row = tuple[int, int, int]  # (addr, nbytes, dev_id): one NIXL descriptor
Groups = dict[tuple[str, str], tuple[list[Row], list[Row]]]  # (local, remote) kinds


class Span(NamedTuple):
    """``nbytes`` bytes at ``addr`` in registered memory of kind ``mem`` on device ``dev_id``."""

    addr: int
    nbytes: int
    dev_id: int = 0
    mem: str = "DRAM"

    def to_wire(self) -> list[int]:
        """``[addr, nbytes, dev_id, mem_code]`` (JSON-able; mem_code indexes :data:`MEM_KINDS`)."""
        return [self.addr, self.nbytes, self.dev_id, MEM_KINDS.index(self.mem)]

    @classmethod
    def from_wire(cls, item: Any) -> Span:
        """Rebuild a span a peer sent; raises :class:`~kvstore.errors.ProtocolError` unless it
        is 2 to 4 non-negative ints (addr and nbytes non-zero, a known mem code)."""
        try:
            return remote_span(item)
        except InvalidArgument as exc:
            raise ProtocolError(str(exc)) from exc


@dataclass(frozen=True, eq=False)
class Registration:
    """Memory registered with an agent: ``nbytes`` at ``addr`` of kind ``mem`` on ``dev_id``.

    Holds a reference to the registered tensor so it outlives the registration.
    """

    addr: int
    nbytes: int
    mem: str
    dev_id: int
    tensor: Any = field(repr=False)
    _dlist: Any = field(repr=False)

    def span(self, offset: int = 0, nbytes: int | None = None) -> Span:
        """The span of ``[offset, offset + nbytes)`` of this registration (default: to the
        end). Never blocks; raises :class:`~kvstore.errors.InvalidArgument` out of range."""
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n <= 0 or offset + n > self.nbytes:
            raise InvalidArgument(f"[{offset}, +{n}) is outside a {self.nbytes}-byte registration")
        return Span(self.addr + offset, n, self.dev_id, self.mem)

    def covers(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies inside this registration."""
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


def tensor_region(tensor: Any) -> tuple[int, int, str, int]:
    """``(addr, nbytes, mem, dev_id)`` of a contiguous CPU/CUDA tensor."""
    if not hasattr(tensor, "data_ptr") or not hasattr(tensor, "is_contiguous"):
        raise InvalidArgument(f"expected a torch tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise InvalidArgument("tensor must be contiguous")
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    if nbytes == 0:
        raise InvalidArgument("tensor is empty")
    if getattr(tensor, "is_cpu", False):  # ~1 µs cheaper than tensor.device.type
        return int(tensor.data_ptr()), nbytes, "DRAM", 0
    kind = tensor.device.type
    if kind == "cuda":
        return int(tensor.data_ptr()), nbytes, "VRAM", int(tensor.device.index or 0)
    raise InvalidArgument(f"cannot register {kind} memory with NIXL (cpu or cuda only)")


def remote_span(item: Any) -> Span:
    if not isinstance(item, (tuple, list)) or not 2 <= len(item) <= 4:
        raise InvalidArgument(f"a remote span is (addr, nbytes[, dev_id[, mem]]), got {item!r}")
    span = Span(*item)
    mem = MEM_KINDS[span.mem] if span.mem in (0, 1) and type(span.mem) is int else span.mem
    ints = (span.addr, span.nbytes, span.dev_id)
    if not all(type(v) is int for v in ints) or min(ints) < 0 or 0 in ints[:2]:
        raise InvalidArgument(f"bad remote span {item!r}")
    if mem not in MEM_KINDS:
        raise InvalidArgument(f"bad memory kind in remote span {item!r}")
    return span._replace(mem=mem)


_PLAIN_SPANS = (Span, tuple, list)


def remote_row(item: Any) -> tuple[int, int, int, str]:
    """``(addr, nbytes, dev_id, mem)`` of a remote span, as :func:`remote_span` checks it;
    the shapes callers send (a Span, a 2- or 4-item tuple or list) without building one."""
    if type(item) in _PLAIN_SPANS and len(item) in (2, 4):
        addr, nbytes, dev, mem = item if len(item) == 4 else (item[0], item[1], 0, "DRAM")
        if type(mem) is int and 0 <= mem < len(MEM_KINDS):
            mem = MEM_KINDS[mem]
        if (
            type(addr) is int
            and type(nbytes) is int
            and type(dev) is int
            and addr > 0
            and nbytes > 0
            and dev >= 0
            and type(mem) is str
            and mem in MEM_KINDS
        ):
            return addr, nbytes, dev, mem
    span = remote_span(item)  # anything else: the general check (and its error message)
    return span.addr, span.nbytes, span.dev_id, span.mem


def local_row(item: Any, registrations: Iterable[Registration]) -> tuple[int, int, int, str]:
    """``(addr, nbytes, dev_id, mem)`` of a local span, which must lie in a registration."""
    if hasattr(item, "data_ptr"):
        addr, nbytes, _, _ = tensor_region(item)
    elif isinstance(item, (tuple, list)) and len(item) >= 2:
        addr, nbytes = item[0], item[1]
        if type(addr) is not int or type(nbytes) is not int or nbytes <= 0:
            raise InvalidArgument(f"bad local span {item!r}")
    else:
        raise InvalidArgument(f"a local span is a tensor, Span or (addr, nbytes), got {item!r}")
    for reg in registrations:
        if reg.addr <= addr and addr + nbytes <= reg.addr + reg.nbytes:
            return addr, nbytes, reg.dev_id, reg.mem
    raise InvalidArgument(
        f"local [{addr:#x}, +{nbytes}) is not inside memory this agent registered"
    )


def pair_up(
    remote: Sequence[Any], local: Sequence[Any], registrations: Sequence[Registration]
) -> tuple[Groups, int]:
    """Validate span pairs and group them by (local kind, remote kind) as descriptor rows
    (lists of ``(addr, nbytes, dev_id)``: NIXL builds its lists from those at least as fast
    as from arrays); also the bytes in all."""
    if len(remote) != len(local):
        raise InvalidArgument(f"{len(remote)} remote spans but {len(local)} local ones")
    if len(remote) > MAX_DESCRIPTORS:
        raise InvalidArgument(f"{len(remote)} spans in one call; the limit is {MAX_DESCRIPTORS}")
    groups: Groups = {}
    total = 0
    for r_item, l_item in zip(remote, local, strict=True):
        raddr, rsize, rdev, rmem = remote_row(r_item)
        laddr, lsize, ldev, lmem = local_row(l_item, registrations)
        if rsize != lsize:
            raise InvalidArgument(f"span lengths differ: remote {rsize}, local {lsize}")
        pair = groups.get((lmem, rmem))
        if pair is None:
            pair = groups[lmem, rmem] = ([], [])
        pair[0].append((laddr, lsize, ldev))
        pair[1].append((raddr, rsize, rdev))
        total += rsize
    return groups, total
