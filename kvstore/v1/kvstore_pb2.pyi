from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "data_uri", "transport", "nixl_metadata", "tiers", "version", "host", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_URI_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_uri: str
    transport: str
    nixl_metadata: bytes
    tiers: _containers.RepeatedCompositeFieldContainer[Tier]
    version: str
    host: str
    session: bytes
    def __init__(self, node_id: _Optional[str] = ..., data_uri: _Optional[str] = ..., transport: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., tiers: _Optional[_Iterable[_Union[Tier, _Mapping]]] = ..., version: _Optional[str] = ..., host: _Optional[str] = ..., session: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("epoch", "lease_s", "commit_port")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    COMMIT_PORT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_s: float
    commit_port: int
    def __init__(self, epoch: _Optional[int] = ..., lease_s: _Optional[float] = ..., commit_port: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "tiers", "counters", "session", "tenant_bytes", "tenant_evictions")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TenantBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TenantEvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    tiers: _containers.RepeatedCompositeFieldContainer[Tier]
    counters: _containers.ScalarMap[str, int]
    session: bytes
    tenant_bytes: _containers.ScalarMap[str, int]
    tenant_evictions: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., session: _Optional[bytes] = ..., tenant_bytes: _Optional[_Mapping[str, int]] = ..., tenant_evictions: _Optional[_Mapping[str, int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("ok", "reregister", "draining", "tenant_quotas")
    class TenantQuotasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    OK_FIELD_NUMBER: _ClassVar[int]
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TENANT_QUOTAS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reregister: bool
    draining: bool
    tenant_quotas: _containers.ScalarMap[str, int]
    def __init__(self, ok: _Optional[bool] = ..., reregister: _Optional[bool] = ..., draining: _Optional[bool] = ..., tenant_quotas: _Optional[_Mapping[str, int]] = ...) -> None: ...

class BlockAdd(_message.Message):
    __slots__ = ("ns_id", "block_hash", "chunks", "location")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    block_hash: bytes
    chunks: _containers.RepeatedScalarFieldContainer[int]
    location: bytes
    def __init__(self, ns_id: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ..., chunks: _Optional[_Iterable[int]] = ..., location: _Optional[bytes] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("ns_id", "block_hash")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    block_hash: bytes
    def __init__(self, ns_id: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class ObjectAdd(_message.Message):
    __slots__ = ("key", "nbytes", "version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    nbytes: int
    version: int
    def __init__(self, key: _Optional[str] = ..., nbytes: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "seq", "adds", "evicts", "object_adds", "object_removes", "tiers", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ADDS_FIELD_NUMBER: _ClassVar[int]
    EVICTS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ADDS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_REMOVES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    seq: int
    adds: _containers.RepeatedCompositeFieldContainer[BlockAdd]
    evicts: _containers.RepeatedCompositeFieldContainer[BlockRef]
    object_adds: _containers.RepeatedCompositeFieldContainer[ObjectAdd]
    object_removes: _containers.RepeatedScalarFieldContainer[str]
    tiers: _containers.RepeatedCompositeFieldContainer[Tier]
    session: bytes
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., adds: _Optional[_Iterable[_Union[BlockAdd, _Mapping]]] = ..., evicts: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., object_adds: _Optional[_Iterable[_Union[ObjectAdd, _Mapping]]] = ..., object_removes: _Optional[_Iterable[str]] = ..., tiers: _Optional[_Iterable[_Union[Tier, _Mapping]]] = ..., session: _Optional[bytes] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("applied_seq", "commit_port")
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    COMMIT_PORT_FIELD_NUMBER: _ClassVar[int]
    applied_seq: int
    commit_port: int
    def __init__(self, applied_seq: _Optional[int] = ..., commit_port: _Optional[int] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("node_id", "data_uri", "epoch", "mask", "location")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_URI_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_uri: str
    epoch: int
    mask: bytes
    location: bytes
    def __init__(self, node_id: _Optional[str] = ..., data_uri: _Optional[str] = ..., epoch: _Optional[int] = ..., mask: _Optional[bytes] = ..., location: _Optional[bytes] = ...) -> None: ...

class BlockHolders(_message.Message):
    __slots__ = ("holders",)
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    def __init__(self, holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ns_id", "block_hashes", "chunks_per_block")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    chunks_per_block: int
    def __init__(self, ns_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., chunks_per_block: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHolders]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockHolders, _Mapping]]] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("ns_id", "block_hashes", "chunks_per_block", "block_tokens", "skip_holders")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    chunks_per_block: int
    block_tokens: int
    skip_holders: bool
    def __init__(self, ns_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., chunks_per_block: _Optional[int] = ..., block_tokens: _Optional[int] = ..., skip_holders: _Optional[bool] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("blocks", "holders")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    holders: _containers.RepeatedCompositeFieldContainer[BlockHolders]
    def __init__(self, blocks: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[BlockHolders, _Mapping]]] = ...) -> None: ...

class NodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "alive", "suspect", "draining", "lease_age_s", "epoch", "data_uri", "transport", "nixl_metadata", "tiers", "version", "host", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LEASE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATA_URI_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    alive: bool
    suspect: bool
    draining: bool
    lease_age_s: float
    epoch: int
    data_uri: str
    transport: str
    nixl_metadata: bytes
    tiers: _containers.RepeatedCompositeFieldContainer[Tier]
    version: str
    host: str
    counters: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., alive: _Optional[bool] = ..., suspect: _Optional[bool] = ..., draining: _Optional[bool] = ..., lease_age_s: _Optional[float] = ..., epoch: _Optional[int] = ..., data_uri: _Optional[str] = ..., transport: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., tiers: _Optional[_Iterable[_Union[Tier, _Mapping]]] = ..., version: _Optional[str] = ..., host: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class NodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("ns_id", "block_hashes", "chunks_per_block")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    chunks_per_block: int
    def __init__(self, ns_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., chunks_per_block: _Optional[int] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("kind", "block_index", "chunks", "node_id", "reason", "epoch", "location")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WatchEvent.Kind]
        COMMIT: _ClassVar[WatchEvent.Kind]
        EVICT: _ClassVar[WatchEvent.Kind]
        ABORT: _ClassVar[WatchEvent.Kind]
        SNAPSHOT_DONE: _ClassVar[WatchEvent.Kind]
    KIND_UNSPECIFIED: WatchEvent.Kind
    COMMIT: WatchEvent.Kind
    EVICT: WatchEvent.Kind
    ABORT: WatchEvent.Kind
    SNAPSHOT_DONE: WatchEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    kind: WatchEvent.Kind
    block_index: int
    chunks: _containers.RepeatedScalarFieldContainer[int]
    node_id: str
    reason: str
    epoch: int
    location: bytes
    def __init__(self, kind: _Optional[_Union[WatchEvent.Kind, str]] = ..., block_index: _Optional[int] = ..., chunks: _Optional[_Iterable[int]] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ..., location: _Optional[bytes] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[WatchEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[WatchEvent, _Mapping]]] = ...) -> None: ...

class RouteInstance(_message.Message):
    __slots__ = ("id", "active_tokens", "cached_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    active_tokens: int
    cached_tokens: int
    def __init__(self, id: _Optional[str] = ..., active_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("ns_id", "block_hashes", "chunks_per_block", "block_tokens", "prompt_tokens", "instances", "overlap_weight", "transfer_weight", "load_weight")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    chunks_per_block: int
    block_tokens: int
    prompt_tokens: int
    instances: _containers.RepeatedCompositeFieldContainer[RouteInstance]
    overlap_weight: float
    transfer_weight: float
    load_weight: float
    def __init__(self, ns_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., chunks_per_block: _Optional[int] = ..., block_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., instances: _Optional[_Iterable[_Union[RouteInstance, _Mapping]]] = ..., overlap_weight: _Optional[float] = ..., transfer_weight: _Optional[float] = ..., load_weight: _Optional[float] = ...) -> None: ...

class RouteScore(_message.Message):
    __slots__ = ("id", "own_tokens", "pool_tokens", "prefill_tokens", "loaded_tokens", "active_tokens", "cost")
    ID_FIELD_NUMBER: _ClassVar[int]
    OWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    id: str
    own_tokens: int
    pool_tokens: int
    prefill_tokens: int
    loaded_tokens: int
    active_tokens: int
    cost: float
    def __init__(self, id: _Optional[str] = ..., own_tokens: _Optional[int] = ..., pool_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., active_tokens: _Optional[int] = ..., cost: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("choice", "pool_tokens", "scores")
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    choice: str
    pool_tokens: int
    scores: _containers.RepeatedCompositeFieldContainer[RouteScore]
    def __init__(self, choice: _Optional[str] = ..., pool_tokens: _Optional[int] = ..., scores: _Optional[_Iterable[_Union[RouteScore, _Mapping]]] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("ns_id", "after_seq", "log_id", "snapshot")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    after_seq: int
    log_id: str
    snapshot: bool
    def __init__(self, ns_id: _Optional[bytes] = ..., after_seq: _Optional[int] = ..., log_id: _Optional[str] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("seq", "kind", "ns_id", "block_hash", "node_id", "epoch", "chunks", "medium", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ClusterEvent.Kind]
        STORED: _ClassVar[ClusterEvent.Kind]
        REMOVED: _ClassVar[ClusterEvent.Kind]
        NODE_DEAD: _ClassVar[ClusterEvent.Kind]
        CLEARED: _ClassVar[ClusterEvent.Kind]
        SNAPSHOT_DONE: _ClassVar[ClusterEvent.Kind]
    KIND_UNSPECIFIED: ClusterEvent.Kind
    STORED: ClusterEvent.Kind
    REMOVED: ClusterEvent.Kind
    NODE_DEAD: ClusterEvent.Kind
    CLEARED: ClusterEvent.Kind
    SNAPSHOT_DONE: ClusterEvent.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: ClusterEvent.Kind
    ns_id: bytes
    block_hash: bytes
    node_id: str
    epoch: int
    chunks: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    reason: str
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[ClusterEvent.Kind, str]] = ..., ns_id: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., chunks: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EventsResponse(_message.Message):
    __slots__ = ("log_id", "events")
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    log_id: str
    events: _containers.RepeatedCompositeFieldContainer[ClusterEvent]
    def __init__(self, log_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[ClusterEvent, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("ns_id", "block_hashes", "reason")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    reason: str
    def __init__(self, ns_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupObjectRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class ObjectHolder(_message.Message):
    __slots__ = ("node_id", "data_uri", "nbytes", "epoch", "version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_URI_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_uri: str
    nbytes: int
    epoch: int
    version: int
    def __init__(self, node_id: _Optional[str] = ..., data_uri: _Optional[str] = ..., nbytes: _Optional[int] = ..., epoch: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class LookupObjectResponse(_message.Message):
    __slots__ = ("holders",)
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[ObjectHolder]
    def __init__(self, holders: _Optional[_Iterable[_Union[ObjectHolder, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("nodes", "live_nodes", "capacity_bytes", "used_bytes", "blocks", "objects", "hits", "misses", "tenants")
    NODES_FIELD_NUMBER: _ClassVar[int]
    LIVE_NODES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    live_nodes: int
    capacity_bytes: int
    used_bytes: int
    blocks: int
    objects: int
    hits: int
    misses: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    def __init__(self, nodes: _Optional[int] = ..., live_nodes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., objects: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "used_bytes", "quota_bytes", "evictions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    used_bytes: int
    quota_bytes: int
    evictions: int
    def __init__(self, tenant: _Optional[str] = ..., used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id", "undrain", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    undrain: bool
    session: bytes
    def __init__(self, node_id: _Optional[str] = ..., undrain: _Optional[bool] = ..., session: _Optional[bytes] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class ReportNodeRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportNodeResponse(_message.Message):
    __slots__ = ("suspect",)
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    suspect: bool
    def __init__(self, suspect: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    session: bytes
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class DataTicketRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataTicketResponse(_message.Message):
    __slots__ = ("ticket", "key", "expires_unix", "role", "tenant")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    key: bytes
    expires_unix: float
    role: str
    tenant: str
    def __init__(self, ticket: _Optional[bytes] = ..., key: _Optional[bytes] = ..., expires_unix: _Optional[float] = ..., role: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...
