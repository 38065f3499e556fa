"""The parsers that read a peer's bytes, fuzzed: data-plane headers (every request and reply
parser) on arbitrary JSON values, every unary master handler on arbitrary protobuf bytes
(hypothesis, bounded), and ``bench/fuzz.py``'s mutational run over frames, headers, the
handshake, chunks and master requests plus a live ``kvstore serve`` under fuzz beside an
honest client (a short run; the long one is in bench/RESULTS.md). Every input is answered
or refused with a ``KVStoreError``; nothing else escapes, nothing hangs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.control.client import _InProcessContext
from kvstore.dataplane import handshake as hs
from kvstore.dataplane import messages as m
from kvstore.errors import KVStoreError
from kvstore.master.index import MemoryIndexStore
from kvstore.master.membership import Membership
from kvstore.master.service import MasterService
from kvstore.v1 import kvstore_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=5),
    max_leaves=30,
)  # fmt: skip
_FIELDS = ["op", "ns", "ns_id", "chunks", "wait_s", "writer", "grant", "key", "nbytes",
           "blocks", "ttl_s", "hold_id", "lease_s", "stored", "skipped", "failed", "busy",
           "grants", "grant_s", "accept", "spans", "found", "code", "message", "ticket", "nonce",
           "proof", "mac", "v", "role", "tenant", "exp"]  # fmt: skip
_header = st.fixed_dictionaries(
    {
        "op": st.sampled_from(
            [*m.REQUESTS, "ack", "reserved", "data", "error", "hello", "challenge", "proof", "x"]
        )
    },
    optional={k: _json for k in _FIELDS[1:]},
)
_ROOT = hs.ticket_root("fuzz-cluster-secret-0123")
_REPLIES = [m.Ack, m.Ready, m.Found, m.Leased, m.Held, m.Unheld, m.Removed, m.Evicted,
            m.Reported, m.NodeStats]  # fmt: skip
_VALID = [
    m.Put(b"\x01" * 40, (m.PutChunk(b"\x02" * 16, b"\x03" * 16, 0, 64),), 0.5, True, True,
          "w", (1,)),
    m.Get(b"\x04" * 16, (m.ChunkRef(b"\x05" * 16, 0),)),
    m.Lease(b"\x04" * 16, (m.ChunkRef(b"\x05" * 16, 1),), 2.0),
    m.Hold(b"\x04" * 16, (b"\x05" * 16,), 3.0), m.PutObject("key", 10),
    m.Evict(b"\x04" * 16, (b"\x06" * 16,)), m.Report(b"\x04" * 16, (m.ChunkRef(b"\x05" * 16, 0),)),
    m.Ack(2, 1, (0,), (1,), ((0, 1, b"\x01" * 8),), 5.0), m.Ready((0, 1)), m.Found((1, 0)),
    m.Leased((1,), ((1, 2, 3, 0),), 2.0), m.Held("h1", 2), m.Evicted(1, 0),
]  # fmt: skip


@st.composite
def _near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A valid message's header with one or two fields replaced by arbitrary JSON."""
    header = dict(draw(st.sampled_from(_VALID)).header())
    for name in draw(st.lists(st.sampled_from(sorted(header)), min_size=1, max_size=2)):
        header[name] = draw(_json)
    return header


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(_near_valid(), _header, st.dictionaries(st.sampled_from(_FIELDS), _json,
                                                         max_size=6)))  # fmt: skip
def test_data_plane_headers_parse_or_refuse(header: dict[str, Any]) -> None:
    json.dumps(header)  # (a header that came off the wire)
    try:
        m.parse_request(header)
    except KVStoreError:
        pass
    for cls in _REPLIES:
        try:
            m.expect(header, cls)
        except KVStoreError:
            pass
    for hs_cls in (hs.Hello, hs.Challenge, hs.Proof):  # the data port's handshake
        try:
            hs_cls.parse(header)
        except KVStoreError:
            pass
    try:
        hs.Ticket.verify(_ROOT, json.dumps(header).encode())
    except KVStoreError:
        pass


_METHODS = [
    ("Register", pb.RegisterRequest), ("Heartbeat", pb.HeartbeatRequest),
    ("Commit", pb.CommitRequest), ("Lookup", pb.LookupRequest),
    ("MatchPrefix", pb.MatchPrefixRequest), ("Abort", pb.AbortRequest),
    ("LookupObject", pb.LookupObjectRequest), ("Drain", pb.DrainRequest),
    ("ReportNode", pb.ReportNodeRequest), ("Deregister", pb.DeregisterRequest),
    ("Route", pb.RouteRequest), ("Stats", pb.StatsRequest), ("Nodes", pb.NodesRequest),
    ("DataTicket", pb.DataTicketRequest),
]  # fmt: skip


@pytest.fixture(scope="module")
def service() -> Any:
    loop = asyncio.new_event_loop()
    svc = MasterService(MemoryIndexStore(), Membership(10.0))
    loop.run_until_complete(
        svc.Register(
            pb.RegisterRequest(node_id="n1", data_uri="tcp://127.0.0.1:1"),
            _InProcessContext("Register"),
        )
    )
    yield svc, loop
    loop.close()


@pytest.mark.parametrize("method,request_type", _METHODS, ids=[n for n, _ in _METHODS])
def test_master_handlers_answer_or_refuse_any_bytes(
    service: Any, method: str, request_type: Any
) -> None:
    svc, loop = service

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=300))
    def check(data: bytes) -> None:
        try:
            request = request_type.FromString(data)
        except DecodeError:
            return  # gRPC refuses it before the handler
        try:
            handler = getattr(svc, method)(request, _InProcessContext(method))
            loop.run_until_complete(asyncio.wait_for(handler, 5))
        except KVStoreError:
            pass

    check()


@pytest.mark.slow
def test_mutational_run_and_a_server_under_fuzz(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fuzz.py"), "--cases", "20000", "--server-s", "4",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["cases"] == 20000 and result["crashes"] == 0
    assert set(result["targets"]) == {"frame", "header", "handshake", "chunk", "proto"}
    live = result["server"]
    assert live["honest_failures"] == [] and live["wrong_bytes"] == 0
    assert live["honest_ops"] > 0 and live["fuzz_frames"] > 0 and live["fuzz_rpcs"] > 0
    assert (live["exit_status"], live["pinned"]) == (0, "pinned_slots=0")


_ID16 = st.binary(min_size=16, max_size=16)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_ID16, st.one_of(st.none(), _ID16, st.just("previous")),
                          st.integers(0, 63)), min_size=1, max_size=12))  # fmt: skip
def test_put_chunks_survive_the_wire_whatever_their_parents(
    items: list[tuple[bytes, bytes | str | None, int]],
) -> None:
    """A put's chunks come back from its header as they were sent: parents that are the
    block before (which the parser reuses), other blocks, none, and repeated blocks."""
    chunks, before = [], None
    for block, parent, index in items:
        up = before if parent == "previous" else parent
        assert not isinstance(up, str)
        chunks.append(m.PutChunk(block, up, index, 64))
        before = block
    put = m.Put(b"\x01" * 40, tuple(chunks))
    assert m.Put.parse(json.loads(json.dumps(put.header()))) == put


def test_a_put_chunk_without_a_parent_has_none_whatever_the_header_says() -> None:
    """An empty or null parent is no parent, first chunk or not (never an empty hash)."""
    block, other = "ab" * 16, "cd" * 16
    for empty in ("", None):
        chunks = [[block, empty, 0, 64], [other, empty, 0, 64], [block, other, 1, 64]]
        header = {"op": "put", "ns": "01" * 40, "wait_s": 0, "chunks": chunks}
        parsed = m.Put.parse(header).chunks
        assert [c.parent for c in parsed] == [None, None, bytes.fromhex(other)]
