"""kvstore master: the control plane (membership, the block and object index, watches).

:class:`MasterServer` runs one; :class:`MasterClient` talks to one; :class:`IndexStore`
is the seam for index backends (:class:`MemoryIndexStore` today).
"""

from kvstore.control.client import MasterClient, error_from_rpc
from kvstore.control.records import (
    BlockAdd,
    BlockRef,
    CommitBatch,
    HeartbeatReply,
    Holder,
    Holding,
    MasterStats,
    NodeInfo,
    NodeRecord,
    ObjectAdd,
    ObjectHolder,
    PrefixMatch,
    Registration,
    Tier,
    WatchEvent,
    WatchKind,
)
from kvstore.errors import StaleEpoch
from kvstore.master.index import IndexStore, MemoryIndexStore, Subscription
from kvstore.master.membership import Membership, MemberStatus
from kvstore.master.server import MasterConfig, MasterServer
from kvstore.master.service import MasterCounters, MasterService

__all__ = [
    "BlockAdd",
    "BlockRef",
    "CommitBatch",
    "HeartbeatReply",
    "Holder",
    "Holding",
    "IndexStore",
    "MasterClient",
    "MasterConfig",
    "MasterCounters",
    "MasterServer",
    "MasterService",
    "MasterStats",
    "MemberStatus",
    "Membership",
    "MemoryIndexStore",
    "NodeInfo",
    "NodeRecord",
    "ObjectAdd",
    "ObjectHolder",
    "PrefixMatch",
    "Registration",
    "StaleEpoch",
    "Subscription",
    "Tier",
    "WatchEvent",
    "WatchKind",
    "error_from_rpc",
]
