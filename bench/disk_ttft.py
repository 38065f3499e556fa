"""Time to first token on the reference engine for a disk hit, beside recompute and a host hit.

    python bench/disk_ttft.py [--lengths 1024,2048,4096,8192,16384] [--reps 2]
                              [--quants int8,none] [--layers 8] [--hidden 256] [--heads 4]
                              [--kv-heads 2] [--host-mem 256MiB] [--disk-size 4GiB]
                              [--dir PATH] [--plot disk_ttft.png]

One run starts its own ``kvstore serve`` (loopback, port 0) with a host-memory tier of
``--host-mem`` and a disk tier below it (``--disk-path``: a fresh directory under ``--dir``,
default the current directory, which must not be a tmpfs; deleted at exit), and the two
engine processes of ``bench/pd.py`` (a *prefill* and a *decode* instance of
``examples/reference_engine``: transformers' Llama, random weights; needs the ``engine``
extra; its ``job`` runs one request). Per prompt length, rep and ``--quants`` codec, on a
fresh prompt each time:

- **recompute**: the decode instance computes the whole prompt itself (no pool; once per
  rep, shared by the codecs' rows);
- **host hit**: the prefill instance computes the prompt, saving each layer, and reports
  its saves done; the node's disk writer is let finish (stats ``queued`` 0 and ``written``
  grown by the prompt's blocks); then the decode instance loads the prompt from the pool
  (from host memory) and computes its tail;
- **disk hit**: the same prompt is then pushed out of host memory: filler prompts of the
  same namespace (``put_layer`` from this process, random KV, ``--fill`` x ``--host-mem``
  bytes of blocks) evict it, so only its disk copy is left; once the disk writer is idle
  again, the decode instance loads it once more, now read from disk (checked, staged into
  host memory cold) and computes its tail.

TTFT: the decode instance's ``generate`` call start to its first token (``time.monotonic``;
the pool's ``match_prefix``, the load and the tail's compute; recompute: the whole forward
pass). Before each timed request the disk writer is let go idle, so no write runs beside
it. Each disk hit is checked in the node's stats (``kvstore.dataplane.NodeClient.stats``,
tier ``disk``): its ``read`` and ``staged_cold`` + ``staged_warm`` counters must each grow
by at least the blocks the decode loaded (``read`` by more when one block is read more than
once) — the table shows the deltas, and the notes a host hit's (which must be 0).
A first round at the first length warms both engines and is not counted.

Target (the disk-tier issue): a disk hit beats recompute from 2k tokens up on the
reference engine. Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._common import (
    DISK_COUNTERS,
    BarPanel,
    BenchError,
    Serve,
    Table,
    expect,
    explain,
    print_report,
    progress,
    save_bar_plot,
    spawn_worker,
)
from bench.pd import BLOCK_TOKENS, ENGINE_BLOCK, _prompt, close_job, job
from kvstore.errors import CapacityError

TARGET_FROM = 2048
"""The target holds from this many prompt tokens up."""
FILL_PIECE = 2048
"""Tokens of one filler put (one ``put_layer`` per layer)."""
SETTLE_S = 300.0
"""How long the disk writer may take to go idle before a measurement gives up."""


async def _disk_stats_async(uri: str) -> dict[str, Any]:
    from kvstore.dataplane import NodeClient

    stats = await asyncio.wait_for(NodeClient(uri, timeout_s=10).stats(), 20)
    (disk,) = [t for t in stats["tiers"] if t["name"] == "disk"]
    return dict(disk)


def disk_stats(uri: str) -> dict[str, Any]:
    """The node's ``disk`` tier entry of its stats."""
    return asyncio.run(_disk_stats_async(uri))


def settle(uri: str, written_at_least: int = 0, quiet_s: float = 0.2) -> dict[str, Any]:
    """Wait until the disk writer is idle: nothing queued, ``written`` at least
    ``written_at_least`` and unchanged over ``quiet_s``. Its last stats."""
    deadline = time.monotonic() + SETTLE_S
    last = disk_stats(uri)
    while True:
        time.sleep(quiet_s)
        now = disk_stats(uri)
        idle = now["queued"] == 0 and now["written"] == last["written"]
        if idle and now["written"] >= written_at_least:
            return now
        expect(
            time.monotonic() < deadline,
            f"the disk writer did not go idle in {SETTLE_S:.0f} s "
            f"(want written >= {written_at_least}): {now}",
        )
        last = now


class Filler:
    """Puts random prompts of one namespace from this process until ``nbytes`` of blocks
    went in: what pushes earlier blocks out of host memory."""

    def __init__(self, master: str, quant: str, sizes: dict[str, int]) -> None:
        import torch

        import kvclient
        from examples.reference_engine import namespace
        from kvstore.core.codec import chunk_nbytes

        self.ns = namespace("llama", quant, 0, BLOCK_TOKENS, **sizes)
        self.kv = kvclient.SyncKVClient.connect(master, self.ns, timeout_s=120)
        self.layers = sizes["num_hidden_layers"]
        heads, dim = self.ns.num_kv_heads, self.ns.head_dim
        gen = torch.Generator().manual_seed(7)
        self.kvt = torch.randn(2, FILL_PIECE, heads, dim, generator=gen)
        self.seed = 10**9
        self.refused = 0
        """Filler puts the node refused (``CapacityError``), each retried after a pause."""
        chunk = chunk_nbytes(BLOCK_TOKENS, heads, dim, torch.float32, quant)
        self.block_bytes = chunk * self.layers
        """Bytes one pool block of the namespace holds (its chunks, every layer)."""

    def fill(self, nbytes: int) -> int:
        """Put pieces until ``nbytes`` of blocks went in; the blocks put."""
        blocks = 0
        while blocks * self.block_bytes < nbytes:
            self.seed += 1
            tokens = _prompt(FILL_PIECE, self.seed)
            for layer in range(self.layers):
                for _ in range(100):
                    try:
                        self.kv.put_layer(tokens, layer, self.kvt)
                        break
                    except CapacityError:
                        self.refused += 1
                        time.sleep(0.1)
                else:
                    raise BenchError("the node refused a filler put 100 times")
            blocks += FILL_PIECE // BLOCK_TOKENS
        return blocks

    def close(self) -> None:
        self.kv.close()


def _ttft(d: dict[str, Any]) -> float:
    return (d["first_token"] - d["start"]) * 1e3


def _load(d: dict[str, Any]) -> float:
    return (d["layer_ready"][-1] - d["start"]) * 1e3


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after[key]) - int(before[key])


def one_round(
    pre: Any,
    dec: Any,
    master: str,
    data: str,
    quants: list[str],
    fillers: dict[str, Filler],
    sizes: dict[str, int],
    n: int,
    seed: int,
    args: argparse.Namespace,
    tick: Callable[[], None],
) -> dict[str, Any]:
    """One rep at ``n`` tokens: recompute, then per codec a host hit and a disk hit of one
    fresh prompt. TTFTs in ms, loads in ms, and the disk counters' deltas."""
    max_len = max(int(x) for x in args.lengths.split(","))
    out: dict[str, Any] = {}
    settle(data)
    d = dec.submit(job, master, "recompute", "none", sizes, _prompt(n, seed), False, max_len)
    out["recompute"] = _ttft(d.result())
    tick()
    for k, quant in enumerate(quants):
        prompt = _prompt(n, seed * 10 + k + 1)
        before = disk_stats(data)
        p = pre.submit(job, master, "prefill", quant, sizes, prompt, False, max_len).result()
        expect("saved" in p, "the prefill's saves were not reported done")
        # Its blocks written to disk, nothing else in flight.
        s0 = settle(data, before["written"] + n // BLOCK_TOKENS)
        d = dec.submit(job, master, "decode", quant, sizes, prompt, False, max_len).result()
        expect(d["recomputed_from"] is None and d["loaded"] > 0, f"host hit loaded nothing: {d}")
        s1 = disk_stats(data)
        out[(quant, "host")] = _ttft(d)
        out[(quant, "host load")] = _load(d)
        out[(quant, "host read")] = _delta(s1, s0, "read")
        tick()
        # Push it out of host memory; wait until the filler's writes are done too.
        fillers[quant].fill(int(args.fill * args.host_mem_bytes))
        s2 = settle(data)
        d = dec.submit(job, master, "decode", quant, sizes, prompt, False, max_len).result()
        expect(d["recomputed_from"] is None and d["loaded"] > 0, f"disk hit loaded nothing: {d}")
        s3 = disk_stats(data)
        out[(quant, "disk")] = _ttft(d)
        out[(quant, "disk load")] = _load(d)
        out[(quant, "loaded blocks")] = -(-d["loaded"] // BLOCK_TOKENS)
        out[(quant, "disk read")] = _delta(s3, s2, "read")
        out[(quant, "cold")] = _delta(s3, s2, "staged_cold")
        out[(quant, "warm")] = _delta(s3, s2, "staged_warm")
        out[(quant, "errors")] = _delta(s3, s2, "errors")
        tick()
    return out


def measure(args: argparse.Namespace) -> tuple[list[Table], dict[str, Any]]:
    from kvstore.core.sizes import parse_size

    lengths = [int(x) for x in args.lengths.split(",")]
    quants = [q for q in args.quants.split(",") if q]
    args.host_mem_bytes = parse_size(args.host_mem)
    sizes = {
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": 2 * args.hidden,
        "max_position_embeddings": max(lengths) + 64,
    }
    rows: dict[int, list[dict[str, Any]]] = {n: [] for n in lengths}
    info: dict[str, Any] = {}
    with contextlib.ExitStack() as stack, progress() as bar:
        where = tempfile.mkdtemp(prefix="kvstore-disk-ttft-", dir=args.dir)
        stack.callback(shutil.rmtree, where, True)
        serve = stack.enter_context(
            Serve.start(
                "--host-mem", args.host_mem, "--disk-path", where, "--disk-size", args.disk_size
            )
        )
        master, data = serve.addresses["grpc"], serve.addresses["data"]
        pre, dec = spawn_worker(stack, close_job), spawn_worker(stack, close_job)
        fillers: dict[str, Filler] = {}
        for q in quants:
            fillers[q] = Filler(master, q, sizes)
            stack.callback(fillers[q].close)
        steps = (len(lengths) * args.reps + 1) * (1 + 2 * len(quants))
        task = bar.add_task("disk ttft", total=steps)
        start = time.monotonic()
        plan = [(lengths[0], False)] + [(n, True) for n in lengths for _ in range(args.reps)]
        for seed, (n, counted) in enumerate(plan, 1):  # the first round warms both up
            row = one_round(
                pre, dec, master, data, quants, fillers, sizes, n, seed, args,
                lambda: bar.advance(task),
            )  # fmt: skip
            if counted:
                rows[n].append(row)
        info["wall_s"] = time.monotonic() - start
        info["stats"] = disk_stats(data)
        info["fstype"] = _fstype(where)
        info["refused"] = sum(f.refused for f in fillers.values())
    return _tables(lengths, quants, rows, args, sizes, info), info


def _fstype(path: str) -> str:
    """The file system type of ``path`` (from ``/proc/mounts``: the longest mount prefix)."""
    best, kind = "", "unknown"
    real = str(Path(path).resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and real.startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})"
    return kind


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _tables(
    lengths: list[int],
    quants: list[str],
    rows: dict[int, list[dict[str, Any]]],
    args: argparse.Namespace,
    sizes: dict[str, int],
    info: dict[str, Any],
) -> list[Table]:
    head = Table(
        "Time to first token (ms, median): recompute, host hit, disk hit",
        [
            "prompt tokens",
            "quant",
            "recompute",
            "host hit",
            "disk hit",
            "disk ÷ recompute",
            "disk ÷ host",
            "disk read counters (per rep)",
            f"target (disk < recompute from {TARGET_FROM // 1024}k)",
        ],
    )
    plot: dict[str, list[float]] = {"recompute": []}
    for q in quants:
        plot[f"host hit {q}"], plot[f"disk hit {q}"] = [], []
    met_all = True
    for n in lengths:
        rs = rows[n]
        rec = _med([r["recompute"] for r in rs])
        plot["recompute"].append(rec)
        for q in quants:
            host = _med([r[(q, "host")] for r in rs])
            disk = _med([r[(q, "disk")] for r in rs])
            plot[f"host hit {q}"].append(host)
            plot[f"disk hit {q}"].append(disk)
            counters = "; ".join(
                f"read +{r[(q, 'disk read')]}/{r[(q, 'loaded blocks')]} blocks, "
                f"cold +{r[(q, 'cold')]}, warm +{r[(q, 'warm')]}"
                + (f", errors +{r[(q, 'errors')]}" if r[(q, "errors")] else "")
                for r in rs
            )
            from_disk = all(
                r[(q, "disk read")] >= r[(q, "loaded blocks")]
                and r[(q, "cold")] + r[(q, "warm")] >= r[(q, "loaded blocks")]
                for r in rs
            )
            if not from_disk:
                counters += " (NOT all from disk)"
            if n < TARGET_FROM:
                verdict = "n/a"
            else:
                ok = disk < rec and from_disk
                met_all &= ok
                verdict = "met" if ok else "**not met**"
            head.add(
                n,
                q,
                f"{rec:.1f}",
                f"{host:.1f}",
                f"{disk:.1f}",
                f"{disk / rec:.2f}",
                f"{disk / host:.2f}",
                counters,
                verdict,
            )
    stats = info["stats"]
    head.notes += [
        f"Target: {'met' if met_all else 'NOT met'} at every length from {TARGET_FROM} tokens "
        "(disk hit median below recompute, every disk hit read wholly from disk).",
        f"Llama {sizes['num_hidden_layers']} layers, hidden {sizes['hidden_size']}, "
        f"{sizes['num_attention_heads']} heads, {sizes['num_key_value_heads']} KV heads, "
        f"float32 KV; engine blocks of {ENGINE_BLOCK}, pool blocks of {BLOCK_TOKENS}; "
        f"{args.reps} reps after one warm-up round at {lengths[0]} tokens; prefill and decode "
        "in their own processes on one host, kvstore serve in a third.",
        f"Node: host memory {args.host_mem}, disk tier {args.disk_size} on "
        f"{info['fstype']}, O_DIRECT {stats.get('direct')}; each disk hit after "
        f"{args.fill:g} x host memory of filler blocks. TTFT = the decode's generate call to "
        "its first token (match, load, tail compute; recompute: its whole forward).",
        "Disk read counters: per rep, the node's disk `read` delta over the disk-hit "
        "request / the pool blocks the decode loaded, and `staged_cold` / `staged_warm` "
        "deltas (a disk hit counts as served from disk when both `read` and the blocks "
        "staged reach the blocks loaded); host hits read "
        + ", ".join(
            f"{q} +{sum(r[(q, 'host read')] for n in lengths for r in rows[n])}" for q in quants
        )
        + " blocks from disk in all.",
        "Node disk counters at the end: "
        + ", ".join(f"{k} {stats.get(k)}" for k in (*DISK_COUNTERS, "slots"))
        + (f"; fault: {stats['fault']}" if stats.get("fault") else "")
        + f". Filler puts refused (CapacityError, retried): {info['refused']}"
        + f". Measured part of the run: {info['wall_s']:.0f} s.",
    ]
    loads = Table(
        "The decode's load: generate call to the last layer in (ms, median)",
        ["prompt tokens", "quant", "host hit load", "disk hit load", "disk ÷ host"],
    )
    for n in lengths:
        for q in quants:
            h = _med([r[(q, "host load")] for r in rows[n]])
            d = _med([r[(q, "disk load")] for r in rows[n]])
            loads.add(n, q, f"{h:.1f}", f"{d:.1f}", f"{d / h:.2f}")
    loads.notes.append("Includes the pool's match; the tail's compute follows it.")
    if args.plot:
        panel = BarPanel("TTFT by prompt length", "ms", [str(n) for n in lengths], plot)
        save_bar_plot(args.plot, [panel], "bench/disk_ttft.py: reference engine, TTFT")
    return [head, loads]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quants", default="int8,none", help="pool codecs, comma-separated")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--host-mem", default="256MiB")
    p.add_argument("--disk-size", default="4GiB")
    p.add_argument("--fill", type=float, default=1.25, help="filler, x host memory")
    p.add_argument("--dir", default=".", help="where the disk tier's temp dir goes (no tmpfs)")
    p.add_argument("--plot", default="")
    args = explain(p, __doc__).parse_args(argv)
    tables, _ = measure(args)
    print_report("bench/disk_ttft.py", "bench/disk_ttft.py", argv, tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
