"""The device check: what only a machine with CUDA can show, in one run of a few minutes.

    python bench/gpu_check.py [--device cuda] [--quick] [--json PATH]

Sections, each a Markdown table printed as the section ends (progress on stderr; a
section that raises is reported in its place and the others still run):

1. **The device**: its name and memory, and the copy bandwidth it measures here (device to
   device, host to device, device to host) — what the codec is compared with.
2. **The codec on the device**: ``encode_blocks`` and a layer's ``decode_chunk`` calls for
   INT8 (eager, and fused: Triton, with its first-call compile time), INT4 and raw, on a
   2048-token bf16 layer (H=8, D=128), GB/s of KV beside a device ``copy_`` of the same
   bytes; and whether the device's chunks are byte for byte the CPU's (same scheme, same
   checksum kind).
3. **Stream ordering**: KV written by a kernel queued behind slow ones on a side stream,
   handed to ``start_put_layer`` on that stream at once: the pool must hold the kernel's
   values, not what the tensor held before (the client records an event on the caller's
   stream and encodes after it).
4. **A node with a GPU tier** (``kvstore serve --transport ucx --gpu-mem``): a writer
   process puts CUDA KV, a reader process gets it into CUDA tensors; every byte is
   checked, GB/s of KV reported, and the node's stats say which tier holds the blocks.
   GPU-direct: the writer's chunks must be WRITE'd from the registered staging on its device
   (none through the host), the reader's READ into its device's staging, with no codec copy
   beyond the transfer on either side.
5. **The tests that skip without CUDA** (the CUDA cases of ``tests/test_node_tiers.py``),
   run with pytest; their summary line.

``--device cpu`` runs sections 1 to 4 on CPU tensors (section 4 without a GPU tier, over
``ucx://`` where NIXL is installed, section 5
skipped; with ``--quick`` also the fused codec, whose CPU compile alone takes ~15 s): the
suite runs it so that the script works the first time a GPU is lent. On a
machine without CUDA, ``--device cuda`` (the default) says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "clients"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Serve, Table, explain, machine_markdown, progress  # noqa: E402

import kvclient  # noqa: E402
from kvclient.ucx import nixl_available, staging_device  # noqa: E402
from kvstore.core import fused  # noqa: E402
from kvstore.core.codec import ChunkKey, copy_stats, decode_chunk, encode_blocks  # noqa: E402
from kvstore.core.kvgen import realistic_kv  # noqa: E402

TOKENS, BLOCK, H, D = 2048, 256, 8, 128


def _timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds per call over ``reps`` calls (after one warm-up), synchronised."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def device_table(device: torch.device, reps: int) -> tuple[Table, float]:
    """The device and its copy bandwidths; returns the device-to-device GB/s too."""
    table = Table("The device", ["what", "value"])
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        table.add("device", f"{props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        table.add("device", "cpu (dry run)")
    n = 256 * 2**20
    src, dst = (
        torch.empty(n, dtype=torch.uint8, device=device),
        torch.empty(n, dtype=torch.uint8, device=device),
    )
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2d = n / _timed(lambda: dst.copy_(src), device, reps) / 1e9
    table.add("copy_ device to device, GB/s", f"{d2d:.1f}")
    table.add(
        "copy_ host to device, GB/s",
        f"{n / _timed(lambda: dst.copy_(host), device, reps) / 1e9:.1f}",
    )
    table.add(
        "copy_ device to host, GB/s",
        f"{n / _timed(lambda: host.copy_(src), device, reps) / 1e9:.1f}",
    )
    return table, d2d


def codec_table(device: torch.device, reps: int, compile_cpu: bool = True) -> Table:
    """The codec's GB/s on the device beside a device copy_ of the same KV bytes, and
    whether the device writes the CPU's bytes."""
    layer = realistic_kv(TOKENS, H, D, torch.bfloat16, seed=1).to(device)
    n = TOKENS // BLOCK
    keys = [ChunkKey(bytes([i]) * 16, 0, 0) for i in range(n)]
    kv_bytes = layer.numel() * layer.element_size()
    copy_s = _timed(lambda: torch.empty_like(layer).copy_(layer), device, reps)
    table = Table(
        f"Codec on {device.type}: one {TOKENS}-token bf16 layer (H={H}, D={D}, {n} blocks)",
        ["scheme", "path", "encode GB/s", "decode GB/s", "vs copy_ (enc / dec)",
         "first call s", "bytes = CPU's"],
    )  # fmt: skip
    out = torch.empty_like(layer)
    cpu_layer = layer.cpu()
    paths = [("int8", "eager"), ("int8", "fused"), ("int4", "eager"), ("none", "eager")]
    for quant, mode in paths:
        if mode == "fused" and device.type == "cpu" and not compile_cpu:
            continue
        fused.set_mode(mode)
        t0 = time.perf_counter()
        rows = torch.stack(encode_blocks(layer, BLOCK, keys, quant))  # the device's checksum
        if device.type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        enc = _timed(
            lambda q=quant, r=rows: encode_blocks(layer, BLOCK, keys, q, out=r), device, reps
        )

        def decode_layer(r: torch.Tensor = rows) -> None:
            for i in range(n):
                decode_chunk(r[i], out=out[:, i * BLOCK : (i + 1) * BLOCK])

        dec = _timed(decode_layer, device, reps)
        on_device = torch.stack(encode_blocks(layer, BLOCK, keys, quant, checksum="xxh3_64"))
        fused.set_mode("eager")
        on_cpu = torch.stack(encode_blocks(cpu_layer, BLOCK, keys, quant, checksum="xxh3_64"))
        same = torch.equal(on_device.cpu(), on_cpu)
        fused.set_mode(None)
        table.add(quant, mode, f"{kv_bytes / enc / 1e9:.2f}", f"{kv_bytes / dec / 1e9:.2f}",
                  f"{copy_s / enc:.2f}x / {copy_s / dec:.2f}x", f"{first:.2f}",
                  "yes" if same else "NO")  # fmt: skip
    table.notes.append(
        "fused on CUDA is Triton compiled by torch.compile (first call includes the compile); "
        "timed chunks carry the device's checksum (mulsum64 on CUDA, computed there); the "
        "byte comparison encodes both with xxh3_64"
    )
    return table


RUN = f"{os.getpid()}-{time.time_ns()}"
"""This run's namespace revision (a reader process is told it)."""


def _namespace(tag: str, layers: int, run: str = RUN) -> kvclient.Namespace:
    return kvclient.Namespace(model=f"gpu-check-{tag}", revision=run,
                              num_layers=layers, num_kv_heads=H, head_dim=D,
                              dtype="bfloat16", block_tokens=BLOCK, quant="int8")  # fmt: skip


def stream_table(master: str, device: torch.device) -> Table:
    """KV written by a kernel behind slow ones on a side stream, put at once from it."""
    table = Table("Stream ordering: start_put_layer right after the kernel that writes the KV",
                  ["case", "stored", "pool holds the kernel's values"])  # fmt: skip
    ns = _namespace("stream", 1)
    tokens = list(range(TOKENS))
    want = realistic_kv(TOKENS, H, D, torch.bfloat16, seed=7).to(device)
    with kvclient.SyncKVClient.connect(master, ns, timeout_s=60) as kv:
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        kv_t = torch.zeros_like(want)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                big = torch.randn(4096, 4096, device=device)
                for _ in range(30):  # ~ms of work queued ahead of the write
                    big = torch.tanh(big @ big)
                kv_t.copy_(want + 0 * big[0, 0].to(want.dtype))
                handle = kv.start_put_layer(tokens, 0, kv_t)
        else:
            kv_t.copy_(want)
            handle = kv.start_put_layer(tokens, 0, kv_t)
        stored = handle.wait(60)
        got = kv.get_layer(tokens, 0)
        ref = torch.cat([decode_chunk(c) for c in encode_blocks(
            want.cpu(), BLOCK, [ChunkKey(h, 0, 0) for h in kv.block_hashes(tokens)], ns.quant
        )], dim=1)  # fmt: skip
        case = "side stream, 30 slow kernels ahead" if side is not None else "cpu"
        table.add(case, str(stored.tokens), "yes" if torch.equal(got.cpu(), ref) else "NO")
    return table


def _reader(master: str, device: str, layers: int, run: str, queue: Any) -> None:
    """The reader process: get every layer into device tensors, report time and bytes."""
    ns = _namespace("tier", layers, run)
    tokens = list(range(TOKENS))
    with kvclient.SyncKVClient.connect(master, ns, timeout_s=60) as kv:
        outs = [torch.empty(2, TOKENS, H, D, dtype=torch.bfloat16, device=device)
                for _ in range(layers)]  # fmt: skip
        copies = copy_stats().extra_copies
        found = [kv.get_layer(tokens, 0, out=outs[0]).shape[1]]  # untimed: the set-up
        t0 = time.perf_counter()
        for layer in range(1, layers):
            found.append(kv.get_layer(tokens, layer, out=outs[layer]).shape[1])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed, copies = time.perf_counter() - t0, copy_stats().extra_copies - copies
        digests = [(n, xxhash.xxh3_64_hexdigest(out.cpu().contiguous().view(torch.uint8).numpy()))
                   for n, out in zip(found, outs, strict=True)]  # fmt: skip
        queue.put((elapsed, digests, dict(kv._client._ucx.stats.read), copies))


def tier_table(master: str, data_uri: str, device: torch.device, layers: int) -> Table:
    """A writer (this process) and a reader (another) of CUDA KV through the node."""
    ns = _namespace("tier", layers)
    tokens = list(range(TOKENS))
    kvs = [
        realistic_kv(TOKENS, H, D, torch.bfloat16, seed=20 + i).to(device) for i in range(layers)
    ]
    with kvclient.SyncKVClient.connect(master, ns, timeout_s=60) as kv:
        copies = copy_stats().extra_copies
        kv.put_layer(tokens, 0, kvs[0])  # untimed: the client's agent, staging and peer
        t0 = time.perf_counter()
        for layer, t in enumerate(kvs[1:], start=1):
            kv.put_layer(tokens, layer, t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        put_s, put_copies = time.perf_counter() - t0, copy_stats().extra_copies - copies
        ucx = kv._client._ucx
        written = (ucx.stats.written_in_place, ucx.stats.written_copied)
        staged_on = [str(d) for d in ucx.devices()]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_reader, args=(master, str(device), layers, RUN, queue))
    proc.start()
    get_s, digests, read_into, get_copies = queue.get(timeout=300)
    proc.join(60)
    refs = []
    keys = kvclient.block_hashes(ns, tokens)
    for layer, t in enumerate(kvs):
        chunks = encode_blocks(t.cpu(), BLOCK, [ChunkKey(h, layer, 0) for h in keys], ns.quant)
        ref = torch.cat([decode_chunk(c) for c in chunks], dim=1).contiguous()
        refs.append((TOKENS, xxhash.xxh3_64_hexdigest(ref.view(torch.uint8).numpy())))
    kv_bytes = (layers - 1) * kvs[0].numel() * kvs[0].element_size()  # (the timed layers)
    # (kvctl's entry point through this interpreter: the package need not be installed)
    kvctl = [sys.executable, "-c", "import sys; from kvctl.main import main; sys.exit(main())"]
    stats = subprocess.run([*kvctl, "--master", master, "stats", "--json"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    tiers = "?"
    if stats.returncode == 0:
        with_tiers = json.loads(stats.stdout).get("tiers", [])
        tiers = ", ".join(
            f"{t.get('name')}: {t.get('used_bytes', 0) / 2**20:.0f} MiB" for t in with_tiers
        )
    node = "a node with a GPU tier" if device.type == "cuda" else "a host-only node (dry run)"
    table = Table(f"Writer and reader processes of {device.type} KV through {node}",
                  ["what", "value"])  # fmt: skip
    table.add(f"put_layer x {layers - 1} layers after a first, GB/s of KV",
              f"{kv_bytes / put_s / 1e9:.2f}")  # fmt: skip
    table.add(f"get_layer x {layers - 1} layers after a first (other process), GB/s of KV",
              f"{kv_bytes / get_s / 1e9:.2f}")  # fmt: skip
    table.add("every layer read back as encoded", "yes" if digests == refs else "NO")
    chunks, here = layers * (TOKENS // BLOCK), str(staging_device(device))
    in_place, copied = written
    table.add("put: chunks WRITE'd in place / copied into staging first", f"{in_place} / {copied}")
    table.add("put: registered staging on", ", ".join(staged_on) or "none (no ucx://)")
    table.add("get: chunks READ into staging, by device", str(read_into or "none (no ucx://)"))
    table.add("codec copies beyond the transfer (put, get)", f"{put_copies}, {get_copies}")
    if nixl_available():  # the node serves ucx://: the GPU-direct checks apply
        direct = written == (chunks, 0) and here in staged_on and read_into == {here: chunks}
        table.add(f"{device.type} chunks moved straight from and into {here} staging",
                  "yes" if direct and put_copies == get_copies == 0 else "NO")  # fmt: skip
    table.add("pool tiers (kvctl stats)", tiers)
    table.add("node", data_uri)
    return table


def tests_table() -> Table:
    """The suite's CUDA cases, which skip on CPU machines."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_node_tiers.py", "-k", "cuda"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    table = Table("Tests that skip without CUDA, on the device", ["command", "exit", "summary"])
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    table.add(" ".join(cmd[2:]), str(done.returncode), summary)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and layers")
    parser.add_argument("--json", default="", help="also write every table here")
    args = explain(parser, __doc__).parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "nothing to check. Run it where a GPU is lent.", file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device(args.device)
    reps, layers = (3, 2) if args.quick else (20, 8)
    sections: list[Table] = []
    errors: list[str] = []
    print(machine_markdown(), flush=True)

    def section(title: str, make: Callable[[], Table]) -> None:
        """Run one section and print its table at once; one that raises is reported and
        the others go on (a first run on a new machine must not lose what did work)."""
        try:
            table = make()
        except Exception as exc:
            errors.append(f"{title}: {type(exc).__name__}: {exc}")
            print(f"### {title}\n\nfailed: {type(exc).__name__}: {exc}\n", flush=True)
            traceback.print_exc()
            return
        sections.append(table)
        print(table.to_markdown(), flush=True)

    gpu = ["--transport", "ucx"] if nixl_available() else []
    gpu += ["--gpu-mem", "2GiB"] if device.type == "cuda" else []
    with progress() as bar:
        task = bar.add_task("device check", total=5)
        section("The device", lambda: device_table(device, reps)[0])
        bar.advance(task)
        section("Codec", lambda: codec_table(device, reps, compile_cpu=not args.quick))
        bar.advance(task)
        try:
            serve = Serve.start("--host-mem", "2GiB", *gpu)
        except Exception as exc:
            errors.append(f"the node: {type(exc).__name__}: {exc}")
            print(f"### A node for the next sections\n\nfailed to start: {exc}\n", flush=True)
        else:
            with serve:
                master = serve.addresses["grpc"]
                section("Stream ordering", lambda: stream_table(master, device))
                bar.advance(task)
                section(
                    "Writer and reader processes",
                    lambda: tier_table(master, serve.addresses["data"], device, layers),
                )
                bar.advance(task)
        if device.type == "cuda":
            section("Tests that skip without CUDA", tests_table)
        bar.advance(task)
    if args.json:
        Path(args.json).write_text(
            json.dumps([t.__dict__ for t in sections], default=str, indent=1)
        )
    failed = [t.title for t in sections if any("NO" in map(str, row) for row in t.rows)]
    if failed:
        print(f"gpu_check: a check failed in: {', '.join(failed)}", file=sys.stderr)
    for error in errors:
        print(f"gpu_check: {error}", file=sys.stderr)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
