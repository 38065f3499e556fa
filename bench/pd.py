"""Time to first token of a disaggregated deployment on the reference engine, by its parts.

    python bench/pd.py [--lengths 1024,2048,4096,8192] [--reps 2] [--layers 8]
                       [--hidden 256] [--heads 4] [--kv-heads 2] [--plot pd.png]

One run starts its own ``kvstore serve`` (loopback, port 0) and two engine processes, a
*prefill* and a *decode* instance of ``examples/reference_engine`` (transformers' Llama,
random weights; needs the ``engine`` extra), and, per prompt length, measures:

- **recompute**: the decode instance computes the whole prompt itself (no pool);
- **whole prompt** (``none`` and ``int8``): the prefill instance computes the prompt,
  saving each layer as it is computed, and reports its saves done; then the decode
  instance loads every layer from the pool and computes the prompt's tail;
- **layer-pipelined** (``none`` and ``int8``): the decode instance is started first, told the
  prompt is being prefilled (``{"kvstore": {"stream": True}}``), and loads each layer as
  the prefill instance saves it, while the prefill computes the next layers.

TTFT is measured from the prefill's forward start to the decode's first token
(``time.monotonic``, one clock for both processes on one host). Parts: prefill compute
(its forward pass), save exposed after it (whole prompt: until every save landed), load
(the decode's reads, whole prompt), **exposed transfer after prefill end** (the decode's
last layer in, minus the prefill's forward end: what the network adds to TTFT) and one
layer's transfer time (whole-prompt load / layers) beside it. Every prompt is fresh, so no
run reuses another's KV.

``--trace PATH`` (default: ``bench/data/mooncake_conversation_sample.jsonl``, the first
2,000 requests of Mooncake's FAST'25 conversation trace; ``--trace ''`` skips it) then
routes that trace over ``--instances`` prefill instances, by KV overlap
(``kvstore.core.routing``, what the ``Route`` RPC answers) and round robin, with and
without the pool (``bench/_routing_sim.py``: a simulation whose per-token compute and load
costs are the ones measured above), and times the ``Route`` RPC itself beside
``match_prefix``. Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._common import (
    BarPanel,
    Serve,
    Table,
    expect,
    explain,
    latency_stats,
    print_report,
    progress,
    save_bar_plot,
    spawn_worker,
)

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_sample.jsonl"
ENGINE_BLOCK = 16
BLOCK_TOKENS = 256

_engines: dict[Any, Any] = {}  # per worker process: (master, role, quant, sizes) -> Engine


def _engine(master: str, role: str, quant: str, sizes: dict[str, int], max_len: int) -> Any:
    import kvclient
    from examples.reference_engine import Engine, build_model, namespace

    key = (master, role, quant, tuple(sorted(sizes.items())))
    if key not in _engines:
        model = build_model("llama", 0, **sizes)
        blocks = -(-max_len // ENGINE_BLOCK) + 8
        kv = None
        if role != "recompute":
            ns = namespace("llama", quant, 0, BLOCK_TOKENS, **sizes)
            kv = kvclient.SyncKVClient.connect(master, ns, timeout_s=120)
        _engines[key] = Engine(
            model,
            kv,
            load=True,
            save=role == "prefill",
            block_size=ENGINE_BLOCK,
            num_blocks=blocks,
            stream_s=300,
        )
    return _engines[key]


def job(
    master: str,
    role: str,
    quant: str,
    sizes: dict[str, int],
    prompt: list[int],
    stream: bool,
    max_len: int,
) -> dict[str, Any]:
    """Run one request in this worker process; its timings (``time.monotonic``)."""
    engine = _engine(master, role, quant, sizes, max_len)
    params = {"kvstore": {"stream": True, "prompt_tokens": len(prompt)}} if stream else None
    start = time.monotonic()
    out = engine.generate(prompt, 1, params)
    return {
        "start": start,
        "tokens": out.tokens,
        "loaded": out.loaded_tokens,
        "recomputed_from": out.recomputed_from,
        **out.timings,
    }


def close_job() -> None:
    for engine in _engines.values():
        if engine.kv is not None:
            engine.kv.close()
    _engines.clear()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def measure(args: argparse.Namespace) -> list[Table]:
    lengths = [int(x) for x in args.lengths.split(",")]
    sizes = {
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": 2 * args.hidden,
        "max_position_embeddings": max(lengths) + 64,
    }
    modes = ["recompute", "none whole", "none pipelined", "int8 whole", "int8 pipelined"]
    ttft: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lengths} for m in modes}
    parts: dict[tuple[int, str], list[dict[str, float]]] = {}
    seed = 0
    with contextlib.ExitStack() as stack, progress() as bar:
        serve = stack.enter_context(Serve.start("--host-mem", args.host_mem))
        master = serve.addresses["grpc"]
        pre, dec = spawn_worker(stack, close_job), spawn_worker(stack, close_job)
        task = bar.add_task("pd", total=len(lengths) * args.reps * len(modes))
        for n in lengths:
            for rep in range(args.reps + 1):  # rep 0 warms both engines up
                for mode in modes:
                    seed += 1
                    prompt = _prompt(n, seed)
                    row = _one(pre, dec, master, mode, sizes, prompt, max(lengths))
                    if rep:
                        ttft[mode][n].append(row["ttft"])
                        parts.setdefault((n, mode), []).append(row)
                        bar.advance(task)
        tables = _tables(lengths, modes, ttft, parts, args, sizes)
        if args.trace:
            tables += _routing_tables(args, master, lengths, parts)
    return tables


def _routing_tables(
    args: argparse.Namespace, master: str, lengths: list[int], parts: dict
) -> list[Table]:
    """The trace routed by KV overlap vs round robin, and the Route RPC's own latency."""
    from _routing_sim import load_requests, simulate

    n = max(lengths)
    compute_s = statistics.median(r["compute"] for r in parts[(n, "recompute")]) / 1e3 / n
    load_s = statistics.median(r["load"] for r in parts[(n, "int8 whole")]) / 1e3 / n
    requests = load_requests(Path(args.trace), args.requests)
    table = Table(
        f"Routing {len(requests)} trace requests over {args.instances} prefill instances",
        ["policy", "prompt tokens reused", "from own cache", "TTFT mean (s)", "p50", "p99"],
    )
    for policy in ("round robin", "kv-aware", "round robin + pool", "kv-aware + pool"):
        o = simulate(
            requests,
            policy,
            instances=args.instances,
            cache_blocks=args.cache_blocks,
            pool_blocks=args.pool_blocks,
            compute_s=compute_s,
            load_s=load_s,
            load=args.load,
        )
        table.add(
            policy,
            f"{o.hit_rate:.1%}",
            f"{o.own_rate:.1%}",
            f"{o.ttft_mean_s:.3f}",
            f"{o.ttft_p50_s:.3f}",
            f"{o.ttft_p99_s:.3f}",
        )
    table.notes.append(
        f"Per instance an own LRU cache of {args.cache_blocks} blocks of 512 tokens; the pool "
        f"an LRU of {args.pool_blocks} blocks. Costs from this run's {n}-token prompts: "
        f"compute {compute_s * 1e6:.1f} µs/token (recompute), load {load_s * 1e6:.2f} µs/token "
        f"(int8 whole-prompt load). Arrivals scaled so round robin without reuse is "
        f"{args.load:.0%} busy. KV-aware: the Route cost (overlap 1, load 1, transfer = the "
        "measured load/compute ratio)."
    )
    return [table, asyncio.run(_route_latency(master))]


async def _route_latency(master: str, calls: int = 300) -> Table:
    """p50/p99 of the Route RPC against match_prefix on the same 32-block prompt."""
    import kvclient
    from kvclient import Instance

    ns = kvclient.Namespace(
        model="bench-route",
        revision="r",
        num_layers=1,
        num_kv_heads=2,
        head_dim=16,
        block_tokens=16,
        quant="int8",
    )
    insts = [Instance(f"i{k}", active_tokens=k * 100, cached_tokens=k * 16) for k in range(8)]
    tokens = _prompt(512, 99)
    times: dict[str, list[float]] = {"route (8 instances)": [], "match_prefix": []}
    async with await kvclient.KVClient.connect(master, ns) as kv:
        for _ in range(calls):
            t = time.perf_counter()
            await kv.route(tokens, insts)
            times["route (8 instances)"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await kv.match_prefix(tokens)
            times["match_prefix"].append(time.perf_counter() - t)
    table = Table(
        f"Route RPC latency ({calls} calls, 32-block prompt)", ["call", "p50 (µs)", "p99 (µs)"]
    )
    for name, ts in times.items():
        stats = latency_stats(ts)
        table.add(name, f"{stats['p50'] * 1e6:.0f}", f"{stats['p99'] * 1e6:.0f}")
    return table


def _one(
    pre: Any,
    dec: Any,
    master: str,
    mode: str,
    sizes: dict[str, int],
    prompt: list[int],
    max_len: int,
) -> dict[str, float]:
    """One request in ``mode``; its TTFT and parts in ms."""
    ms = 1e3
    if mode == "recompute":
        d = dec.submit(job, master, "recompute", "none", sizes, prompt, False, max_len).result()
        return {
            "ttft": (d["first_token"] - d["forward_start"]) * ms,
            "compute": (d["forward_end"] - d["forward_start"]) * ms,
        }
    quant, how = mode.split()
    if how == "whole":
        p = pre.submit(job, master, "prefill", quant, sizes, prompt, False, max_len).result()
        expect("saved" in p, "the prefill's saves were not reported done")
        d = dec.submit(job, master, "decode", quant, sizes, prompt, False, max_len).result()
        expect(d["recomputed_from"] is None and d["loaded"] > 0, f"decode loaded nothing: {d}")
        load = d["layer_ready"][-1] - d["start"]
        exposed = (p["saved"] - p["forward_end"]) + load
        ttft = (p["saved"] - p["forward_start"]) + (d["first_token"] - d["start"])
        layers = len(d["layer_ready"])
        return {
            "ttft": ttft * ms,
            "compute": (p["forward_end"] - p["forward_start"]) * ms,
            "save": (p["saved"] - p["forward_end"]) * ms,
            "load": load * ms,
            "exposed": exposed * ms,
            "layer": load / layers * ms,
        }
    waiting = dec.submit(job, master, "decode", quant, sizes, prompt, True, max_len)
    time.sleep(0.2)  # the decode side schedules and subscribes first
    p = pre.submit(job, master, "prefill", quant, sizes, prompt, False, max_len).result()
    d = waiting.result()
    expect(d["recomputed_from"] is None, f"the stream was recomputed: {d}")
    exposed = max(0.0, d["layer_ready"][-1] - p["forward_end"])
    return {
        "ttft": (d["first_token"] - p["forward_start"]) * ms,
        "compute": (p["forward_end"] - p["forward_start"]) * ms,
        "exposed": exposed * ms,
    }


def _med(rows: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in rows if key in r]
    return f"{statistics.median(values):.1f}" if values else "-"


def _tables(
    lengths: list[int],
    modes: list[str],
    ttft: dict,
    parts: dict,
    args: argparse.Namespace,
    sizes: dict[str, int],
) -> list[Table]:
    head = Table("Time to first token (ms, median)", ["prompt tokens", *modes])
    for n in lengths:
        head.add(n, *(f"{statistics.median(ttft[m][n]):.1f}" for m in modes))
    head.notes.append(
        f"Llama {sizes['num_hidden_layers']} layers, hidden {sizes['hidden_size']}, "
        f"{sizes['num_key_value_heads']} KV heads, float32 KV; engine blocks of {ENGINE_BLOCK}, "
        f"pool blocks of {BLOCK_TOKENS}; {args.reps} reps after one warm-up; prefill and "
        "decode in their own processes on one host, kvstore serve in a third."
    )
    detail = Table(
        "Parts (ms, median)",
        [
            "prompt tokens",
            "mode",
            "prefill compute",
            "save exposed",
            "load",
            "exposed transfer after prefill end",
            "one layer's transfer",
        ],
    )
    layer_of: dict[tuple[int, str], str] = {}
    for n in lengths:
        for q in ("none", "int8"):
            layer_of[(n, q)] = _med(parts[(n, f"{q} whole")], "layer")
    for n in lengths:
        for m in modes:
            rows = parts[(n, m)]
            one = layer_of.get((n, m.split()[0]), "-") if m != "recompute" else "-"
            detail.add(
                n,
                m,
                _med(rows, "compute"),
                _med(rows, "save"),
                _med(rows, "load"),
                _med(rows, "exposed"),
                one,
            )
    detail.notes.append(
        "Exposed transfer after prefill end: whole prompt = the prefill's save wait + the "
        "decode's load; layer-pipelined = the decode's last layer in minus the prefill's "
        "forward end (0 when it landed before). One layer's transfer = whole-prompt load / layers."
    )
    if args.plot:
        panel = BarPanel(
            "TTFT by prompt length",
            "ms",
            [str(n) for n in lengths],
            {m: [statistics.median(ttft[m][n]) for n in lengths] for m in modes},
        )
        save_bar_plot(args.plot, [panel], "bench/pd.py: reference engine, TTFT")
    return [head, detail]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--host-mem", default="1GiB")
    p.add_argument("--plot", default="")
    p.add_argument("--trace", default=str(TRACE), help="Mooncake-format JSONL ('' to skip)")
    p.add_argument("--requests", type=int, default=0, help="trace requests (0: all)")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--cache-blocks", type=int, default=400, help="per instance, 512-token")
    p.add_argument("--pool-blocks", type=int, default=20000)
    p.add_argument("--load", type=float, default=0.8)
    args = explain(p, __doc__).parse_args(argv)
    print_report("bench/pd.py", "bench/pd.py", argv, measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
