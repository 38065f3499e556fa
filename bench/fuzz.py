"""Fuzz every parser that reads bytes from a peer, then a live server under fuzz.

    python bench/fuzz.py [--cases 1000000] [--seed 1] [--server-s 20] [--json PATH]

Parsers, each fed ``--cases`` inputs in all (split evenly), mutated from valid seeds by a
seeded mutator (bit flips, byte and block overwrites, inserts, deletes, truncations,
splices, interesting integers at random offsets, random bytes):

- ``frame``: :func:`kvstore.transport.framing.parse_prefix` (the data port's frame prefix);
- ``header``: :func:`kvstore.dataplane.messages.parse_request` and every reply parser, on
  frame headers decoded from mutated JSON (the node and its clients read these);
- ``handshake``: the data port's hello, challenge and proof parsers and
  :meth:`kvstore.dataplane.handshake.Ticket.verify` (a node reads a ticket's claims before
  anything else on a connection);
- ``chunk``: :func:`kvstore.core.codec.read_header`, :func:`verify_chunk` and
  :func:`decode_chunk` on mutated chunks (what nodes and readers check);
- ``proto``: every unary handler of the master (``MasterService``, in process) on request
  messages decoded from mutated protobuf bytes.

A case passes when the parser returns or raises a ``KVStoreError`` (a typed refusal; an
undecodable protobuf message counts as refused, as gRPC refuses it). Anything else is a
*crash* (its type, message and a sample input are reported). The slowest case and the
process's peak RSS growth are reported too: no hang, no unbounded allocation.

Then, for ``--server-s`` seconds, a real ``kvstore serve`` under fuzz: tasks send mutated
frames and garbage to its data port and mutated protobuf bytes to every master method,
while an honest client puts, matches and reads (checking every byte) beside them; every
honest operation must succeed, and the server must stop cleanly with no slot pinned.
Markdown on stdout, progress on stderr, ``--json`` for every figure. Exit status 1 on any
crash, honest failure or unclean stop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))

import torch
from google.protobuf.message import DecodeError

from bench._common import Serve, Table, explain, print_report, progress
from kvstore.errors import KVStoreError

_INTERESTING = [
    0,
    1,
    0x7F,
    0x80,
    0xFF,
    0x7FFF,
    0xFFFF,
    0x7FFFFFFF,
    0xFFFFFFFF,
    2**63 - 1,
    2**64 - 1,
]


# ---- the mutator ------------------------------------------------------------------------


def mutate(rng: random.Random, seed: bytes, others: list[bytes]) -> bytes:
    """One mutant of ``seed``: one to four random edits (``others``: for splices)."""
    data = bytearray(seed)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        n = len(data)
        if op == 0 and n:  # flip a bit
            i = rng.randrange(n)
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # overwrite a byte
            data[rng.randrange(n)] = rng.randrange(256)
        elif op == 2:  # insert bytes
            i = rng.randint(0, n)
            data[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and n:  # delete a run
            i = rng.randrange(n)
            del data[i : i + rng.randint(1, 16)]
        elif op == 4 and n:  # truncate
            del data[rng.randrange(n) :]
        elif op == 5 and others:  # splice another seed's tail
            other = rng.choice(others)
            i, j = rng.randint(0, n), rng.randint(0, len(other))
            data[i:] = other[j:]
        elif op == 6 and n >= 8:  # an interesting integer at a random offset
            width = rng.choice((1, 2, 4, 8))
            value = rng.choice(_INTERESTING) & ((1 << (8 * width)) - 1)
            i = rng.randrange(max(1, n - width + 1))
            data[i : i + width] = value.to_bytes(width, "little")
        elif op == 7 and n:  # overwrite a block with random bytes
            i = rng.randrange(n)
            k = rng.randint(1, 32)
            data[i : i + k] = rng.randbytes(min(k, n - i))
        else:  # append garbage
            data += rng.randbytes(rng.randint(1, 32))
    return bytes(data)


# ---- targets ----------------------------------------------------------------------------


@dataclass
class Target:
    """A parser: its seeds and how one input is parsed (returns, or raises)."""

    name: str
    seeds: list[bytes]
    parse: Callable[[bytes], object]
    """Parses one input; returns True (or raises a KVStoreError) when it was refused."""
    crashes: Counter[str] = field(default_factory=Counter)
    samples: dict[str, str] = field(default_factory=dict)
    cases: int = 0
    refused: int = 0
    slowest_ms: float = 0.0


def frame_target() -> Target:
    from kvstore.transport.framing import encode_prefix, parse_prefix

    headers = [
        {"op": "put", "ns": "ab" * 20, "chunks": [["00" * 16, "", 0, 64]], "wait_s": 0.0},
        {"op": "get", "ns_id": "11" * 16, "chunks": [["22" * 16, 3]]},
        {"op": "stats"},
        {"op": "ack", "stored": 3, "skipped": 0, "failed": [], "busy": []},
    ]
    seeds = [encode_prefix(h, [64] * (i % 3)) for i, h in enumerate(headers)]
    return Target("frame", seeds, parse_prefix)


def header_target() -> Target:
    from kvstore.dataplane import messages as m
    from kvstore.dataplane.location import SlotLocation

    ns = m.Put(b"\x01" * 40, (m.PutChunk(b"\x02" * 16, None, 0, 64),), 0.5, True, True, "w", (1,))
    loc = SlotLocation(4096, 64, 2, 0, 0).pack()
    seeds_msgs: list[m.Message] = [
        ns, m.Put(b"\x01" * 40, (m.PutChunk(b"\x02" * 16, b"\x03" * 16, 1, 64),)),
        m.Get(b"\x04" * 16, (m.ChunkRef(b"\x05" * 16, 0),)),
        m.Lease(b"\x04" * 16, (m.ChunkRef(b"\x05" * 16, 1),), 2.0),
        m.Hold(b"\x04" * 16, (b"\x05" * 16,), 3.0), m.Unhold("h1"),
        m.PutObject("key", 10), m.GetObject("k"), m.RemoveObject("k"),
        m.Evict(b"\x04" * 16, None), m.Evict(b"\x04" * 16, (b"\x06" * 16,)),
        m.Report(b"\x04" * 16, (m.ChunkRef(b"\x05" * 16, 0),)), m.Stats(),
        m.Ack(2, 1, (0,), (1,), ((0, 1, loc),), 5.0), m.Ready((0, 1)), m.Found((1, 0)),
        m.Leased((1,), ((1, 2, 3, 0),), 2.0), m.Held("h1", 2), m.Unheld(True),
        m.Removed(False), m.Evicted(1, 0), m.Reported(0), m.NodeStats({"slots": 1}),
        m.Error("capacity", "full"),
    ]  # fmt: skip
    seeds = [json.dumps(msg.header()).encode() for msg in seeds_msgs]
    replies = [m.Ack, m.Ready, m.Found, m.Leased, m.Held, m.Unheld, m.Removed, m.Evicted,
               m.Reported, m.NodeStats]  # fmt: skip

    def parse(data: bytes) -> bool:
        try:
            header = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return True  # not JSON: the frame parser refuses it first
        if not isinstance(header, dict):
            return True
        refused = 0
        for parse_one in [m.parse_request, *(lambda h, c=c: m.expect(h, c) for c in replies)]:
            try:
                parse_one(header)
            except KVStoreError:
                refused += 1
        return refused > len(replies)  # refused by every parser

    return Target("header", seeds, parse)


def handshake_target() -> Target:
    """The data port's hello, challenge and proof headers, and a ticket's claims."""
    from kvstore.dataplane import handshake as hs

    root = hs.ticket_root("fuzz-cluster-secret-0123")
    ticket = hs.Ticket.issue(root, "client", "team-a")
    seeds = [ticket.claims] + [
        json.dumps(msg.header()).encode()
        for msg in (hs.Hello(ticket.claims, b"\x01" * 16),
                    hs.Challenge(b"\x02" * 16, b"\x03" * 32), hs.Proof(b"\x04" * 32))
    ]  # fmt: skip

    def parse(data: bytes) -> bool:
        refused = 0
        try:
            hs.Ticket.verify(root, data)
        except KVStoreError:
            refused += 1
        try:
            header = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return True
        if not isinstance(header, dict):
            return True
        for cls in (hs.Hello, hs.Challenge, hs.Proof):
            try:
                cls.parse(header)
            except KVStoreError:
                refused += 1
        return refused == 4

    return Target("handshake", seeds, parse)


def chunk_target() -> Target:
    from kvstore.core.codec import ChunkKey, decode_chunk, encode_chunk, read_header, verify_chunk

    g = torch.Generator().manual_seed(5)
    seeds = []
    for quant in ("int8", "none", "fp8"):
        kv = torch.randn(2, 16, 2, 8, generator=g).bfloat16()
        try:
            seeds.append(bytes(encode_chunk(kv, quant, ChunkKey(b"\x07" * 16, 1, 0)).numpy()))
        except KVStoreError:
            continue

    def parse(data: bytes) -> bool:
        refused = False
        for fn in (read_header, verify_chunk, decode_chunk):
            try:
                fn(data)
            except KVStoreError:
                refused = True
        return refused

    return Target("chunk", seeds, parse)


def proto_target() -> tuple[Target, Callable[[], None]]:
    """Every unary master handler, in process, on mutated request bytes."""
    from kvstore.control.client import _InProcessContext
    from kvstore.master.index import MemoryIndexStore
    from kvstore.master.membership import Membership
    from kvstore.master.service import MasterService
    from kvstore.v1 import kvstore_pb2 as pb

    loop = asyncio.new_event_loop()
    service = MasterService(MemoryIndexStore(), Membership(10.0))
    reg = loop.run_until_complete(
        service.Register(
            pb.RegisterRequest(node_id="n1", data_uri="tcp://127.0.0.1:1"),
            _InProcessContext("Register"),
        )
    )
    h, ns = b"\x01" * 16, b"\x02" * 16
    requests: list[tuple[str, Any]] = [
        ("Register", pb.RegisterRequest(node_id="n2", data_uri="tcp://127.0.0.1:2",
                                        tiers=[pb.Tier(name="host", capacity_bytes=10)])),
        ("Heartbeat", pb.HeartbeatRequest(node_id="n1", epoch=reg.epoch, counters={"a": 1})),
        ("Commit", pb.CommitRequest(node_id="n1", epoch=reg.epoch, seq=1, adds=[
            pb.BlockAdd(ns_id=ns, block_hash=h, chunks=[0, 1], location=b"\x00" * 8)])),
        ("Lookup", pb.LookupRequest(ns_id=ns, block_hashes=[h, h], chunks_per_block=2)),
        ("MatchPrefix", pb.MatchPrefixRequest(ns_id=ns, block_hashes=[h], chunks_per_block=2,
                                              block_tokens=16)),
        ("Nodes", pb.NodesRequest()), ("Stats", pb.StatsRequest()),
        ("Abort", pb.AbortRequest(ns_id=ns, block_hashes=[h], reason="x")),
        ("LookupObject", pb.LookupObjectRequest(key="k")),
        ("Drain", pb.DrainRequest(node_id="n1")),
        ("ReportNode", pb.ReportNodeRequest(node_id="n1", epoch=reg.epoch, reason="r")),
        ("Deregister", pb.DeregisterRequest(node_id="n9", epoch=1)),
        ("Route", pb.RouteRequest(ns_id=ns, block_hashes=[h], chunks_per_block=2,
                                  block_tokens=16, prompt_tokens=20,
                                  instances=[pb.RouteInstance(id="a", active_tokens=3)])),
    ]  # fmt: skip
    seeds = [bytes([i]) + req.SerializeToString() for i, (_, req) in enumerate(requests)]

    def parse(data: bytes) -> bool:
        if not data:
            return True
        method, request = requests[data[0] % len(requests)]
        try:
            msg = type(request).FromString(data[1:])
        except DecodeError:
            return True  # gRPC refuses what does not decode
        try:
            loop.run_until_complete(
                asyncio.wait_for(getattr(service, method)(msg, _InProcessContext(method)), 5)
            )
        except KVStoreError:
            return True
        return False

    return Target("proto", seeds, parse), loop.close


def run_target(target: Target, cases: int, rng: random.Random, tick: Callable[[int], None]) -> None:
    for k in range(cases):
        data = (
            mutate(rng, rng.choice(target.seeds), target.seeds)
            if k % 16
            else rng.randbytes(rng.randint(0, 96))
        )
        t = time.perf_counter()
        try:
            target.refused += target.parse(data) is True
        except KVStoreError:
            target.refused += 1
        except Exception as exc:  # a crash: what no parser may raise
            kind = f"{type(exc).__name__}: {str(exc)[:120]}"
            target.crashes[kind] += 1
            target.samples.setdefault(kind, data[:200].hex())
        target.slowest_ms = max(target.slowest_ms, (time.perf_counter() - t) * 1000)
        target.cases += 1
        if k % 1000 == 999:
            tick(1000)


# ---- a live server under fuzz -----------------------------------------------------------


@dataclass
class ServerRun:
    seconds: float = 0.0
    fuzz_frames: int = 0
    fuzz_rpcs: int = 0
    honest_ops: int = 0
    honest_failures: list[str] = field(default_factory=list)
    wrong_bytes: int = 0
    exit_status: int = -1
    pinned: str = ""


async def _server_fuzz(srv: Serve, seconds: float, rng: random.Random, out: ServerRun) -> None:
    import grpc

    import kvclient
    from kvstore.transport.framing import encode_prefix

    host, port = srv.addresses["data"].removeprefix("tcp://").rsplit(":", 1)
    ns = kvclient.Namespace(model="fuzz-live", revision="1", num_layers=1, num_kv_heads=2,
                            head_dim=16, dtype=torch.bfloat16, block_tokens=16,
                            quant="none")  # fmt: skip
    frames = [encode_prefix({"op": "put", "ns": ns.canonical_bytes().hex(),
                             "chunks": [["ab" * 16, "", 0, 2112]], "wait_s": 0}, [2112]),
              encode_prefix({"op": "get", "ns_id": ns.id.hex(), "chunks": [["ab" * 16, 0]]}, []),
              encode_prefix({"op": "stats"}, [])]  # fmt: skip
    stop = asyncio.Event()

    async def data_fuzzer() -> None:
        while not stop.is_set():
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 2)
            except (OSError, TimeoutError):
                await asyncio.sleep(0.01)
                continue
            try:
                await asyncio.sleep(0.002)  # (the honest client shares this loop)
                for _ in range(rng.randint(1, 5)):
                    w.write(
                        mutate(rng, rng.choice(frames), frames) + rng.randbytes(rng.randint(0, 64))
                    )
                    out.fuzz_frames += 1
                await asyncio.wait_for(w.drain(), 2)
            except (OSError, TimeoutError):
                pass
            finally:
                w.close()

    async def rpc_fuzzer() -> None:
        from kvstore.v1 import kvstore_pb2 as pb

        methods = ["Register", "Heartbeat", "Commit", "Lookup", "MatchPrefix", "Nodes",
                   "Abort", "LookupObject", "Stats", "Drain", "ReportNode", "Deregister",
                   "Route"]  # fmt: skip
        seed = pb.LookupRequest(ns_id=ns.id, block_hashes=[b"\x01" * 16]).SerializeToString()
        async with grpc.aio.insecure_channel(srv.addresses["grpc"]) as channel:
            while not stop.is_set():
                method = rng.choice(methods)
                call = channel.unary_unary(f"/kvstore.v1.Master/{method}")
                try:
                    await call(mutate(rng, seed, [seed]), timeout=2)
                except grpc.RpcError:
                    pass
                out.fuzz_rpcs += 1
                await asyncio.sleep(0.001)

    async def honest() -> None:
        async with await kvclient.KVClient.connect(srv.addresses["grpc"], ns, timeout_s=10) as kv:
            n = 0
            while not stop.is_set():
                n += 1
                tokens = [(n * 7919 + i) % 30000 for i in range(64)]
                g = torch.Generator().manual_seed(n)
                t = torch.randn(2, 64, 2, 16, generator=g).bfloat16()
                try:
                    stored = await kv.put_layer(tokens, 0, t)
                    matched = await kv.match_prefix(tokens)
                    got = await kv.get_layer(tokens, 0)
                    if stored != 64 or matched != 64 or got.shape[1] != 64:
                        out.honest_failures.append(f"op {n}: stored {stored}, matched "
                                                   f"{matched}, read {got.shape[1]}")  # fmt: skip
                    else:  # quant "none": the very bytes written
                        out.wrong_bytes += int((got.view(torch.uint8) != t.view(torch.uint8)).sum())
                except KVStoreError as exc:
                    out.honest_failures.append(f"op {n}: {type(exc).__name__}: {exc}")
                out.honest_ops += 3

    tasks = [asyncio.create_task(f()) for f in (data_fuzzer, data_fuzzer, rpc_fuzzer, honest)]
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    stop.set()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    out.seconds = time.monotonic() - t0
    out.honest_failures += [f"task failed: {r!r}" for r in done if isinstance(r, BaseException)]


def server_under_fuzz(seconds: float, seed: int) -> ServerRun:
    out = ServerRun()
    srv = Serve.start("--host-mem", "64MiB", "--header-timeout-s", "1", "--log-level", "ERROR")
    try:
        asyncio.run(_server_fuzz(srv, seconds, random.Random(seed), out))
    finally:
        srv.proc.send_signal(15)
        try:
            stdout, _ = srv.proc.communicate(timeout=20)
        except Exception:
            srv.proc.kill()
            stdout, _ = srv.proc.communicate(timeout=5)
        out.exit_status = srv.proc.returncode
        out.pinned = next((p for p in stdout.split() if p.startswith("pinned_slots=")), "")
        srv.stderr.close()
    return out


# ---- report -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--server-s", type=float, default=20.0)
    parser.add_argument("--json", default="")
    args = explain(parser, __doc__).parse_args(argv)
    targets = [frame_target(), header_target(), handshake_target(), chunk_target()]
    if args.cases < len(targets) + 1:  # (split evenly over the parsers, proto's included)
        parser.error(f"--cases must be at least {len(targets) + 1}, one per parser")
    logging.getLogger("kvstore").setLevel(logging.ERROR)  # (fuzzed reports log warnings)
    rng = random.Random(args.seed)
    proto, close_proto = proto_target()
    targets.append(proto)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with progress() as bar:
        task = bar.add_task("fuzz", total=args.cases)
        for target in targets:
            bar.update(task, description=f"fuzz: {target.name}")
            run_target(target, args.cases // len(targets), rng, lambda n: bar.advance(task, n))
    close_proto()
    fuzz_s = time.monotonic() - t0
    rss_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    live = server_under_fuzz(args.server_s, args.seed) if args.server_s > 0 else None

    table = Table("Parsers", ["parser", "cases", "refused (typed)", "crashes", "slowest ms"])
    for t in targets:
        table.add(t.name, f"{t.cases:,}", f"{t.refused:,}", sum(t.crashes.values()),
                  round(t.slowest_ms, 2))  # fmt: skip
    total = sum(t.cases for t in targets)
    crashes = {f"{t.name}: {k}": (n, t.samples[k]) for t in targets for k, n in t.crashes.items()}
    table.notes.append(
        f"{total:,} cases ({args.cases // len(targets):,} per parser) in {fuzz_s:.1f} s; "
        f"peak RSS grew {rss_growth_mib:.1f} MiB over the run."
    )
    table.notes.append(
        "refused: the input was refused with a KVStoreError, or earlier by JSON or protobuf "
        "decoding (header: refused by every request and reply parser); the rest parsed."
    )
    for kind, (n, sample) in crashes.items():
        table.notes.append(f"crash x{n}: {kind} (input {sample[:80]}...)")
    tables = [table]
    if live is not None:
        lt = Table("A live kvstore serve under fuzz", ["quantity", "value"])
        lt.add("seconds", round(live.seconds, 1))
        lt.add("fuzzed frames sent to the data port", f"{live.fuzz_frames:,}")
        lt.add("fuzzed messages sent to master methods", f"{live.fuzz_rpcs:,}")
        lt.add("honest operations (put, match, get)", f"{live.honest_ops:,}")
        lt.add("honest failures", len(live.honest_failures))
        lt.add("wrong bytes in honest reads", live.wrong_bytes)
        lt.add("exit status, slots pinned at stop", f"{live.exit_status}, {live.pinned}")
        lt.notes += [f"failure: {f}" for f in live.honest_failures[:5]]
        tables.append(lt)
    else:
        table.notes.append("the live server under fuzz was skipped (--server-s 0)")
    print_report("Fuzzed parsers", "bench/fuzz.py", argv, tables)
    result = {
        "cases": total,
        "seconds": round(fuzz_s, 1),
        "rss_growth_mib": round(rss_growth_mib, 1),
        "targets": {t.name: {"cases": t.cases, "refused": t.refused, "crashes": dict(t.crashes),
                             "slowest_ms": round(t.slowest_ms, 2)} for t in targets},
        "crashes": sum(sum(t.crashes.values()) for t in targets),
        "server": None if live is None else live.__dict__,
    }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    bad_live = live is not None and (
        live.honest_failures or live.wrong_bytes or live.exit_status != 0
        or live.pinned != "pinned_slots=0"
    )  # fmt: skip
    return 1 if result["crashes"] or bad_live else 0


if __name__ == "__main__":
    sys.exit(main())
