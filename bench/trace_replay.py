"""Replay a real request trace through ``kvstore serve``: what an engine pays per request
on the per-layer shape, beside a bare ``grpc.aio`` echo measured in the same run.

    python bench/trace_replay.py [--trace PATH] [--requests N] [--warmup 20] [--plot out.png]

One run starts its own ``kvstore serve`` (master + one storage node, loopback, port 0; the
replay starts once the node has mapped its host memory) and a bare ``grpc.aio`` unary echo
server in a process of its own; this process is the one client. It reads the trace (default:
``bench/data/mooncake_conversation_sample.jsonl``, the first 2,000 requests of the Mooncake
FAST'25 conversation trace, see ``bench/data/README.md``) and replays its requests in order,
one at a time, back to back (the timestamps are not slept to). For each request:

- token ids come from its ``hash_ids``: every hash id becomes the same 16 token ids
  everywhere, so a request of n hash ids is n blocks of a 16-token namespace and requests
  that share a prefix in the trace share their block hashes here;
- timed, in this order: ``KVClient.match_prefix(tokens)`` (the prefix the pool already
  holds); one bare echo round trip with a request of that MatchPrefix request's size and
  a reply of its answer's size; ``put_layer(tokens, 0, kv)`` (``kv`` a fixed random
  ``[2, T, H, D]`` tensor per request length, made before the replay); then
  ``get_layer(tokens, 0)``, which reads the request's longest stored prefix — after the
  put, all its blocks — into a preallocated buffer.

The namespace is "tiny chunks": 1 layer, H=2 KV heads, D=16, bfloat16, int8, 16-token
blocks, so a chunk is 1,352 bytes and a request of ~24 blocks moves ~24 chunks of ~1.3 KiB:
fixed costs (RPCs, exchanges, the event loop) dominate, as on the per-layer shape of an
engine that puts and gets one layer at a time.

Targets (the data-plane work's trace-replay shape, a request of ~24 tiny blocks, one
layer): ``put_layer`` p50 <= 2 ms, and ``match_prefix`` p50 <= 1.3 x the p50 of the bare
``grpc.aio`` echo measured in the same run.

It prints Markdown on stdout (progress on stderr): per-call latency (p50, p90, p99, mean,
ms), the targets, the p50s by blocks per request, and the workload (blocks per request,
the prefix hit rate seen = matched tokens / request tokens, beside the ideal one computed
from the trace).
``--warmup`` synthetic requests of 24 blocks (hash ids no trace uses) open connections
first and are not reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from _common import (
    BarPanel,
    BenchError,
    Serve,
    SpawnedServer,
    Table,
    expect,
    percentile,
    print_report,
    progress,
    save_bar_plot,
)
from service import serve_grpc_echo

from kvclient import KVClient
from kvstore.core.codec import chunk_nbytes
from kvstore.core.hashing import Namespace
from kvstore.core.kvgen import realistic_kv
from kvstore.v1 import kvstore_pb2 as pb

BLOCK, HEADS, HEAD_DIM, LAYERS = 16, 2, 16, 1
DTYPE = torch.bfloat16
TRACE_BLOCK_TOKENS = 512  # what one hash id covers in the original trace
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_sample.jsonl"
MAX_HASH_ID = 2**27  # trace ids stay below; warm-up requests use ids from here on
WARMUP_BLOCKS = 24
IO_TIMEOUT_S = 60.0
CALLS = ("match_prefix", "put_layer", "get_layer", "echo")
TARGET_PUT_P50_S = 2e-3
TARGET_MATCH_RATIO = 1.3


def namespace() -> Namespace:
    """The tiny-chunks namespace: 1 layer, H=2, D=16, bf16, 16-token blocks, int8."""
    return Namespace(
        model="bench-trace",
        revision="r1",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
        block_tokens=BLOCK,
        quant="int8",
    )


# ----------------------------------------------------------------------- the trace


def load_trace(path: Path, limit: int) -> list[list[int]]:
    """The ``hash_ids`` of the first ``limit`` requests of a Mooncake-format JSONL trace
    (``limit`` 0: all of them). Raises :class:`BenchError` for a line that is not such a
    request (no ``hash_ids`` list of ids in ``[0, 2**27)``) or an empty trace."""
    out: list[list[int]] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (ValueError, KeyError, TypeError) as exc:
                raise BenchError(f"{path}:{lineno}: not a trace request ({exc!r})") from exc
            ok = isinstance(ids, list) and bool(ids)
            expect(
                ok and all(isinstance(h, int) and 0 <= h < MAX_HASH_ID for h in ids),
                f"{path}:{lineno}: hash_ids must be a non-empty list of ids in [0, 2**27)",
            )
            out.append(ids)
    expect(bool(out), f"{path}: no requests")
    return out


def tokens_of(hash_ids: Sequence[int]) -> list[int]:
    """Token ids of a request: hash id ``h`` becomes ``16h .. 16h + 15`` wherever it is, so
    equal ids at equal positions give equal block hashes (ids below 2**28 fit in u32)."""
    return [h * BLOCK + j for h in hash_ids for j in range(BLOCK)]


def ideal_hits(trace: Sequence[Sequence[int]]) -> list[int]:
    """Per request, the leading blocks some earlier request already had (same ids up to
    and including that position): the prefix a pool that never evicts would match."""
    trie: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
    hits = []
    for ids in trace:
        node, matched = 0, 0
        for h in ids:
            child = trie.get((node, h))
            if child is None:  # a new node: every later one of this request is new too
                child = trie[(node, h)] = len(trie) + 1
            else:
                matched += 1
            node = child
        hits.append(matched)
    return hits


def warmup_trace(n: int) -> list[list[int]]:
    """``n`` synthetic requests of 24 blocks each, sharing nothing with a trace or each
    other (ids from 2**27 up)."""
    return [[MAX_HASH_ID + k * WARMUP_BLOCKS + j for j in range(WARMUP_BLOCKS)] for k in range(n)]


# ----------------------------------------------------------------------- the replay


@dataclass
class Replay:
    """What one run measured: per reported request its block count, matched tokens and the
    seconds of each call (:data:`CALLS`), and the echo's request and reply sizes."""

    trace: str
    blocks: list[int] = field(default_factory=list)
    matched_tokens: list[int] = field(default_factory=list)
    seconds: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CALLS})
    echo_request_bytes: list[int] = field(default_factory=list)
    echo_reply_bytes: list[int] = field(default_factory=list)
    ideal_blocks: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def echo_payload(ns: Namespace, blocks: int, matched_blocks: int) -> bytes:
    """A request as long as ``KVClient.match_prefix``'s MatchPrefix request for ``blocks``
    blocks; its first 4 bytes ask the echo server for as many bytes as the answer that
    matched ``matched_blocks`` (the echo protocol of ``bench/service.py``)."""
    req = pb.MatchPrefixRequest(
        ns_id=ns.id,
        block_hashes=[bytes(16)] * blocks,
        chunks_per_block=ns.num_layers * ns.tp_size,
        block_tokens=ns.block_tokens,
        skip_holders=True,
    )
    reply = pb.MatchPrefixResponse(blocks=matched_blocks).ByteSize()
    return struct.pack("<I", reply) + req.SerializeToString()[4:]


async def replay(
    master: str,
    echo_addr: str,
    trace: list[list[int]],
    warmup: int,
    res: Replay,
    tick: Callable[[], object],
) -> None:
    """Warm up, then replay ``trace`` one request at a time, filling ``res``; ``tick()``
    after every request (warm-up ones included)."""
    ns = namespace()
    lengths = {len(ids) * BLOCK for ids in trace} | {WARMUP_BLOCKS * BLOCK}
    kvs = {t: realistic_kv(t, HEADS, HEAD_DIM, DTYPE, seed=t) for t in sorted(lengths)}
    out = torch.empty(2, max(lengths), HEADS, HEAD_DIM, dtype=DTYPE)
    async with (
        await KVClient.connect(master, ns, timeout_s=IO_TIMEOUT_S) as kv,
        grpc.aio.insecure_channel(echo_addr) as channel,
    ):
        echo = channel.unary_unary("/bench.Echo/Echo")
        start = time.perf_counter()
        for step, ids in enumerate(warmup_trace(warmup) + trace):
            tokens = tokens_of(ids)
            t = len(tokens)
            t0 = time.perf_counter()
            matched = await kv.match_prefix(tokens)
            t1 = time.perf_counter()
            payload = echo_payload(ns, len(ids), matched // BLOCK)
            t2 = time.perf_counter()
            reply = await echo(payload, timeout=IO_TIMEOUT_S)
            t3 = time.perf_counter()
            stored = await kv.put_layer(tokens, 0, kvs[t])
            t4 = time.perf_counter()
            got = await kv.get_layer(tokens, 0, out=out)
            t5 = time.perf_counter()
            expect(stored == t, f"request {step}: put_layer stored {stored} of {t} tokens")
            expect(got.shape[1] == t, f"request {step}: get_layer read {got.shape[1]} of {t}")
            expect(len(reply) == struct.unpack_from("<I", payload)[0], "echo answered short")
            tick()
            if step < warmup:
                continue
            if step == warmup:
                start = t0
            res.blocks.append(len(ids))
            res.matched_tokens.append(matched)
            for name, s in zip(CALLS, (t1 - t0, t4 - t3, t5 - t4, t3 - t2), strict=True):
                res.seconds[name].append(s)
            res.echo_request_bytes.append(len(payload))
            res.echo_reply_bytes.append(len(reply))
            res.wall_s = time.perf_counter() - start


def run(args: argparse.Namespace) -> Replay:
    """Start ``kvstore serve`` and the echo server, replay, stop both (also on failure)."""
    trace = load_trace(args.trace, args.requests)
    res = Replay(str(args.trace))
    res.ideal_blocks = ideal_hits(trace)
    with contextlib.ExitStack() as stack, progress() as bar:
        task = bar.add_task("starting kvstore serve", total=None)
        serve = stack.enter_context(Serve.start("--host-mem", args.host_mem, mapped=True))
        bar.update(task, description="starting the grpc.aio echo server")
        echo = SpawnedServer.start(serve_grpc_echo)
        stack.callback(echo.stop)
        total = args.warmup + len(trace)
        bar.update(task, description=f"replaying {args.warmup} warm-up + {len(trace)}", total=total)
        asyncio.run(
            replay(
                serve.addresses["grpc"],
                echo.address,
                trace,
                args.warmup,
                res,
                lambda: bar.advance(task),
            )
        )
        bar.update(task, description="stopping")
    return res


# ----------------------------------------------------------------------- report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def latency_table(res: Replay) -> Table:
    """p50 / p90 / p99 / mean of each call, and its p50 over the echo's."""
    n = len(res.blocks)
    table = Table(
        f"Per request: {n} trace requests replayed back to back, one at a time "
        f"({LAYERS} layer, H={HEADS}, D={HEAD_DIM}, bf16, {BLOCK}-token blocks, int8)",
        ["call", "p50 ms", "p90 ms", "p99 ms", "mean ms", "p50 ÷ echo p50"],
    )
    echo_p50 = percentile(res.seconds["echo"], 50)
    labels = {
        "match_prefix": "KVClient.match_prefix(tokens)",
        "put_layer": "KVClient.put_layer(tokens, 0, kv)",
        "get_layer": "KVClient.get_layer(tokens, 0), whole request",
        "echo": "bare grpc.aio unary echo (own process)",
    }
    for call in CALLS:
        s = res.seconds[call]
        table.add(
            labels[call],
            _ms(percentile(s, 50)),
            _ms(percentile(s, 90)),
            _ms(percentile(s, 99)),
            _ms(statistics.fmean(s)),
            f"{percentile(s, 50) / echo_p50:.2f}",
        )
    req, rep = res.echo_request_bytes, res.echo_reply_bytes
    table.notes += [
        f"One client process (this one), {n} samples per call. Chunk: "
        f"{chunk_nbytes(BLOCK, HEADS, HEAD_DIM, DTYPE, 'int8'):,} B; put_layer sends every "
        "full block, the node stores those it lacks (first writer wins) and drops the "
        "rest; get_layer reads every block of "
        "the request (all stored by then) into a preallocated buffer.",
        f"Echo: a request of the MatchPrefix request's size (p50 {statistics.median(req):,.0f}"
        f" B, max {max(req):,} B), a reply of its answer's size (max {max(rep)} B), right "
        "after each match_prefix, on its own channel.",
    ]
    return table


BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 2**31))


def size_table(res: Replay) -> Table:
    """p50 of each call by the request's block count (the targets' shape is ~24 blocks)."""
    table = Table(
        "p50 ms by blocks per request",
        ["blocks", "requests", *(f"{c} p50" for c in CALLS), "match ÷ echo"],
    )
    for lo, hi in BUCKETS:
        idx = [i for i, b in enumerate(res.blocks) if lo <= b <= hi]
        if not idx:
            continue
        p50 = {c: percentile([res.seconds[c][i] for i in idx], 50) for c in CALLS}
        table.add(
            f"{lo}-{hi}" if hi < 2**31 else f"{lo}+",
            len(idx),
            *(_ms(p50[c]) for c in CALLS),
            f"{p50['match_prefix'] / p50['echo']:.2f}",
        )
    return table


def target_table(res: Replay) -> Table:
    """The two targets of the trace-replay shape, met or not."""
    put_p50 = percentile(res.seconds["put_layer"], 50)
    ratio = percentile(res.seconds["match_prefix"], 50) / percentile(res.seconds["echo"], 50)
    table = Table("Targets", ["target", "measured", "met"])
    table.add(
        "put_layer p50 ≤ 2 ms", f"{_ms(put_p50)} ms", "✓" if put_p50 <= TARGET_PUT_P50_S else "✗"
    )
    table.add(
        "match_prefix p50 ≤ 1.3 x echo p50",
        f"{ratio:.2f} x",
        "✓" if ratio <= TARGET_MATCH_RATIO else "✗",
    )
    return table


def workload_table(res: Replay) -> Table:
    """Blocks per request, hit rate seen and ideal, replay wall time."""
    blocks, n = res.blocks, len(res.blocks)
    total = sum(blocks) * BLOCK
    seen = sum(res.matched_tokens) / total
    ideal = sum(res.ideal_blocks) * BLOCK / total
    table = Table("Workload", ["quantity", "value"])
    table.add("trace", f"`{_shown_path(res.trace)}`, first {n} requests")
    table.add(
        "blocks per request, p50 / mean / max",
        f"{statistics.median(blocks):.0f} / {statistics.fmean(blocks):.1f} / {max(blocks)}",
    )
    table.add("blocks replayed (chunks asked for by put_layer)", f"{sum(blocks):,}")
    table.add("prefix hit rate seen (matched tokens ÷ request tokens)", f"{seen:.3f}")
    table.add("ideal hit rate from the trace's hash_ids (no eviction)", f"{ideal:.3f}")
    table.add("replay wall time (s), requests/s", f"{res.wall_s:.1f}, {n / res.wall_s:.0f}")
    table.notes.append(
        f"A trace hash id covers {TRACE_BLOCK_TOKENS} tokens; here each is one {BLOCK}-token "
        "block of the same 16 token ids wherever it appears. Hit rate seen below ideal means "
        "the pool evicted (raise --host-mem)."
    )
    return table


def _shown_path(path: str) -> str:
    p = Path(path).resolve()
    with contextlib.suppress(ValueError):
        return str(p.relative_to(Path(__file__).resolve().parent.parent))
    return str(p)


def plot(res: Replay, path: str) -> None:
    """p50 / p90 / p99 of each call as bars, a PNG at ``path``."""
    series = {f"p{q}": [percentile(res.seconds[c], q) * 1e3 for c in CALLS] for q in (50, 90, 99)}
    panel = BarPanel(
        f"{len(res.blocks)} trace requests, one layer of {BLOCK}-token blocks",
        "ms",
        ["match_prefix", "put_layer", "get_layer", "grpc.aio echo"],
        series,
    )
    save_bar_plot(path, [panel], suptitle="bench/trace_replay.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        metavar="PATH",
        help="Mooncake-format JSONL trace (default: the bundled sample, "
        "bench/data/mooncake_conversation_sample.jsonl)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        metavar="N",
        help="replay the first N requests (default 0: all of the trace)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="synthetic 24-block requests first, not reported (default 20)",
    )
    parser.add_argument(
        "--host-mem", default="512MiB", help="pool size of kvstore serve (default 512MiB)"
    )
    parser.add_argument("--plot", metavar="PNG", help="also write a bar chart here")
    args = parser.parse_args(argv)
    if args.requests < 0 or args.warmup < 0:
        parser.error("need --requests >= 0 and --warmup >= 0")
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the replay and print Markdown; 0 on success."""
    args = parse_args(argv)
    res = run(args)
    tables = (latency_table(res), target_table(res), size_table(res), workload_table(res))
    print_report("Trace replay through kvstore serve", "bench/trace_replay.py", argv, tables)
    if args.plot:
        plot(res, args.plot)
        print(f"Plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
