"""Node membership: epochs and leases, as pure state with the time passed in.

A node registers and gets an epoch (from the index store); it heartbeats every
``lease_s / 3``. Silent for ``lease_s / 2`` it is *suspect* (still read from, no new
placements, its copies listed last), and so it is from a client's report that a read of
it failed until its next heartbeat; silent for ``lease_s`` it is *dead*:
:meth:`Membership.sweep` returns its
``(node_id, epoch)`` once, and the master then drops that epoch from the index. A
heartbeat from an unknown node, a dead one or with another epoch answers "re-register".

After a master restart every node the index still knows is :meth:`restore`\\ d with a
fresh lease (one full lease of grace). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

__all__ = ["MemberStatus", "Membership"]


@dataclass(frozen=True)
class MemberStatus:
    """What the master reports about one node's liveness."""

    epoch: int
    alive: bool
    suspect: bool
    lease_age_s: float


@dataclass
class _Member:
    epoch: int
    last_seen: float
    dead: bool = False
    reported: bool = False
    """A client failed to read from it: suspect until its next heartbeat."""
    remote: bool = False
    """Last seen through the shared store (it heartbeats to another master): this master
    learns of its heartbeats once per sweep, so it is suspect a sweep interval later."""


class Membership:
    """Leases of the nodes of one master. Not thread-safe; every call is O(1) but
    :meth:`sweep`, which is O(nodes)."""

    MAX_DEAD = 1024
    """Dead members remembered (for ``Nodes()``); the oldest are forgotten first."""

    def __init__(self, lease_s: float) -> None:
        if not lease_s > 0:
            raise InvalidArgument(f"node lease must be > 0 s, got {lease_s!r}")
        self.lease_s = float(lease_s)
        self._members: dict[str, _Member] = {}
        self._dead_order: OrderedDict[str, None] = OrderedDict()

    @property
    def suspect_after_s(self) -> float:
        """Silence after which a node is suspect: half a lease."""
        return self.lease_s / 2

    @property
    def sweep_interval_s(self) -> float:
        """How often the master should call :meth:`sweep`: min(1 s, lease / 4)."""
        return min(1.0, self.lease_s / 4)

    def register(self, node_id: str, epoch: int, now: float) -> None:
        """A node registered with a new ``epoch`` at ``now``; any older epoch is forgotten."""
        self._members[node_id] = _Member(epoch, now)
        self._dead_order.pop(node_id, None)

    def restore(self, node_id: str, epoch: int, now: float) -> None:
        """A node known from before a master restart: alive, with one full lease of grace."""
        self.register(node_id, epoch, now)

    def heartbeat(self, node_id: str, epoch: int, now: float, *, remote: bool = False) -> bool:
        """Renew the lease if ``epoch`` is the node's live epoch; False means re-register.
        ``remote``: the heartbeat went to another master (read from the shared store)."""
        member = self._members.get(node_id)
        if member is None or member.dead or member.epoch != epoch:
            return False
        if now >= member.last_seen:
            member.last_seen, member.remote = now, remote
        member.reported = False
        return True

    def report(self, node_id: str, epoch: int) -> bool:
        """A client failed to read from ``epoch`` of ``node_id``: it is suspect until its
        next heartbeat (a dead node sends none, a frozen one neither; one that is fine
        clears it within a third of a lease). False if that epoch is not live."""
        if not self.is_live(node_id, epoch):
            return False
        self._members[node_id].reported = True
        return True

    def leave(self, node_id: str, epoch: int) -> bool:
        """The node says it leaves: ``epoch`` is dead now (never returned by :meth:`sweep`).
        False if that epoch is not live."""
        if not self.is_live(node_id, epoch):
            return False
        self._members[node_id].dead = True
        self._dead_order[node_id] = None
        while len(self._dead_order) > self.MAX_DEAD:
            forgotten, _ = self._dead_order.popitem(last=False)
            self._members.pop(forgotten, None)
        return True

    def is_live(self, node_id: str, epoch: int) -> bool:
        """True if ``epoch`` is the node's epoch and the node is not dead (suspect counts)."""
        member = self._members.get(node_id)
        return member is not None and not member.dead and member.epoch == epoch

    def status(self, node_id: str, now: float) -> MemberStatus | None:
        """Liveness of ``node_id`` at ``now``; None for a node never seen (or forgotten)."""
        member = self._members.get(node_id)
        if member is None:
            return None
        age = max(0.0, now - member.last_seen)
        alive = not member.dead and age < self.lease_s
        late = self.suspect_after_s + (self.sweep_interval_s if member.remote else 0.0)
        return MemberStatus(
            epoch=member.epoch,
            alive=alive,
            suspect=alive and (age >= late or member.reported),
            lease_age_s=age,
        )

    def sweep(self, now: float) -> list[tuple[str, int]]:
        """Mark nodes silent for a full lease dead; return each newly dead (node, epoch)
        once, sorted by node id."""
        newly_dead: list[tuple[str, int]] = []
        for node_id, member in self._members.items():
            if not member.dead and now - member.last_seen >= self.lease_s:
                member.dead = True
                newly_dead.append((node_id, member.epoch))
        for node_id, _ in sorted(newly_dead):
            self._dead_order[node_id] = None
        while len(self._dead_order) > self.MAX_DEAD:
            forgotten, _ = self._dead_order.popitem(last=False)
            self._members.pop(forgotten, None)
        return sorted(newly_dead)

    def live_nodes(self) -> dict[str, int]:
        """Node id -> epoch of every node not (yet) swept dead."""
        return {n: m.epoch for n, m in self._members.items() if not m.dead}

    def validate(self) -> None:
        """Check invariants; raises AssertionError naming the broken one (tests call it)."""
        for node_id, member in self._members.items():
            if member.epoch <= 0:
                raise AssertionError(f"member {node_id!r} has epoch {member.epoch}")
            if member.dead != (node_id in self._dead_order):
                raise AssertionError(f"member {node_id!r} dead flag disagrees with dead order")
        if not set(self._dead_order) <= set(self._members):
            raise AssertionError("dead order names forgotten members")
        if len(self._dead_order) > self.MAX_DEAD:
            raise AssertionError("too many dead members remembered")
