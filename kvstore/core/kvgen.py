"""Synthetic but realistic attention KV, and the study that picks the INT8 and INT4 schemes.

Real K caches are not Gaussian: a few channels per head carry 10-50x the typical
magnitude (they sit in the slow-rotating rotary pairs, so they stay large across a whole
block), each channel has its own mean and spread, and rotary embedding turns pairs of
channels ``(i, i + D/2)`` with the token position at frequencies ``base^(-2i/D)``. V is
close to Gaussian with mild per-channel and per-token scale variation. :func:`realistic_kv`
builds such a ``[2, T, H, D]`` tensor, deterministically from a seed; tests and
benchmarks use it.

:func:`compare_schemes` measures the schemes of :mod:`kvstore.core.codec` by the relative
error of the attention output ``softmax(q Kᵀ/√D) V`` against the original, over many
random queries; :func:`compare_int4_groups` does the same for INT4 at any group size. Run
the study with::

    python -m kvstore.core.kvgen            # prints the table docs/codec.md quotes
    python -m kvstore.core.kvgen --speed --threads 1    # and the speed table
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from kvstore.core import codec, kernels
from kvstore.errors import InvalidArgument

__all__ = [
    "SchemeAccuracy",
    "attention_error",
    "compare_int4_groups",
    "compare_schemes",
    "measure_speed",
    "realistic_kv",
]

_ROPE_BASE = 10000.0


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + D/2)`` of ``x [T, H, D]`` by ``pos · base^(-2i/D)``."""
    d = x.shape[-1]
    half = d // 2
    freqs = _ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) * 2.0 / d)
    angle = positions.to(torch.float64)[:, None] * freqs[None, :]
    cos = angle.cos().to(torch.float32)[:, None, :]
    sin = angle.sin().to(torch.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = x.clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x1 * sin + x2 * cos
    return out


def _k_cache(t: int, h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Pre-rotary K with per-channel means/spreads and a few outlier channels, then RoPE."""
    mean = 0.5 * torch.randn(h, d, generator=gen)
    spread = torch.exp(0.4 * torch.randn(h, d, generator=gen))
    half = max(d // 2, 1)
    n_out = max(1, d // 64)
    for head in range(h):
        # Outliers live in the slow rotary pairs (upper part of the frequency index).
        lo = half // 2
        pairs = lo + torch.randperm(half - lo, generator=gen)[:n_out]
        for p in pairs.tolist():
            magnitude = 10.0 + 40.0 * torch.rand(1, generator=gen).item()
            sign = 1.0 if torch.rand(1, generator=gen).item() < 0.5 else -1.0
            channel = p if torch.rand(1, generator=gen).item() < 0.5 else p + half
            channel = min(channel, d - 1)
            mean[head, channel] = sign * magnitude
            spread[head, channel] *= 1.0 + 0.1 * magnitude
    z = torch.randn(t, h, d, generator=gen)
    pre = mean[None] + spread[None] * z
    start = int(torch.randint(0, 4096, (1,), generator=gen).item())
    positions = torch.arange(start, start + t)
    if d >= 2:
        return _rope(pre, positions)
    return pre


def _v_cache(t: int, h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Near-Gaussian V with mild per-channel and per-token scale variation."""
    channel_scale = torch.exp(0.3 * torch.randn(h, d, generator=gen))
    token_scale = torch.exp(0.2 * torch.randn(t, h, 1, generator=gen))
    return torch.randn(t, h, d, generator=gen) * channel_scale[None] * token_scale


def realistic_kv(
    T: int, H: int, D: int, dtype: torch.dtype = torch.float16, seed: int = 0
) -> torch.Tensor:
    """Return a realistic KV chunk ``[2, T, H, D]`` (K then V) in ``dtype`` on the CPU.

    Deterministic: the same arguments give the same bits on every run of a given torch
    build (CPU generator). Pure computation; never blocks on I/O. Raises
    :class:`InvalidArgument` for non-positive sizes.
    """
    if min(T, H, D) <= 0:
        raise InvalidArgument(f"realistic_kv needs positive sizes, got T={T} H={H} D={D}")
    gen = torch.Generator().manual_seed(int(seed))
    k = _k_cache(T, H, D, gen)
    v = _v_cache(T, H, D, gen)
    return torch.stack([k, v]).to(dtype)


def _attend(kv: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``softmax(q Kᵀ/√D) V`` in float64: ``[Q, H, D]`` for ``kv [2, T, H, D]``."""
    k, v = kv[0].double(), kv[1].double()
    logits = torch.einsum("qhd,thd->hqt", queries.double(), k) / math.sqrt(kv.shape[-1])
    return torch.einsum("hqt,thd->qhd", torch.softmax(logits, dim=-1), v)


def _compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return rel.flatten(), cos.flatten()


def attention_error(
    kv: torch.Tensor, kv_hat: torch.Tensor, queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(query, head) relative error and cosine of ``softmax(q Kᵀ/√D) V``.

    ``kv``/``kv_hat`` are ``[2, T, H, D]``; ``queries`` is ``[Q, H, D]``. Returns two
    float64 tensors of ``Q·H`` values: ``‖o' - o‖ / ‖o‖`` and ``cos(o', o)``.
    """
    return _compare(_attend(kv, queries), _attend(kv_hat, queries))


@dataclass(frozen=True)
class SchemeAccuracy:
    """Accuracy of one scheme on :func:`realistic_kv` data."""

    scheme: str
    median_rel_err: float
    p99_rel_err: float
    mean_cosine: float
    min_cosine: float
    size_ratio: float
    """Encoded chunk bytes over the raw float16 chunk bytes (all overhead included)."""


def compare_schemes(
    T: int = 256,
    H: int = 8,
    D: int = 128,
    dtype: torch.dtype = torch.float16,
    chunks: int = 8,
    queries: int = 128,
    schemes: tuple[str, ...] | None = None,
    seed: int = 0,
) -> list[SchemeAccuracy]:
    """Round-trip ``chunks`` realistic chunks through every scheme and score attention.

    Queries are standard Gaussian ``[queries, H, D]``, one set per chunk. Pure computation
    (a few seconds for the defaults on two cores); returns one row per scheme, in the order
    given (default: every INT8 scheme the codec ships).
    """
    names = schemes or tuple(s for s in codec.SCHEMES if s.startswith("int8-"))
    trips = {
        name: (partial(_codec_round_trip, name), codec.chunk_nbytes(T, H, D, dtype, name))
        for name in names
    }
    return _study(trips, T, H, D, dtype, chunks, queries, seed)


def compare_int4_groups(
    groups: tuple[int, ...] = (8, 16, 32, 64, 128, 256),
    T: int = 256,
    H: int = 8,
    D: int = 128,
    dtype: torch.dtype = torch.float16,
    chunks: int = 8,
    queries: int = 128,
    seed: int = 0,
) -> list[SchemeAccuracy]:
    """:func:`compare_schemes` for INT4 at any group size ``G`` (K per channel over groups
    of up to ``G`` tokens, V per token over groups of up to ``G`` channels, as the codec's
    ``int4-g<G>`` schemes do, through the codec's own kernels): the study behind the
    shipped group sizes. Rows are named ``int4 G=<G>``; sizes count header, scales,
    payload and checksum as a chunk would."""
    trips = {f"int4 G={g}": (partial(_int4_round_trip, g), _int4_nbytes(T, H, D, g))
             for g in groups}  # fmt: skip
    return _study(trips, T, H, D, dtype, chunks, queries, seed)


def _codec_round_trip(scheme: str, kv: torch.Tensor) -> torch.Tensor:
    return codec.decode_chunk(codec.encode_chunk(kv, scheme))


def _int4_round_trip(g: int, kv: torch.Tensor) -> torch.Tensor:
    t, h, d = kv.shape[1:]
    gk, gv = codec.group_size(t, g), codec.group_size(d, g)
    out = torch.empty_like(kv)
    for half, (mode, shape) in enumerate((("kg", (t // gk, h, d)), ("vg", (t, h, d // gv)))):
        scales = [torch.empty(shape, dtype=torch.float16) for _ in range(2)]
        q = torch.empty(t, h, d // 2, dtype=torch.uint8)
        kernels.ENCODERS[mode](kv[half].float(), q, scales)
        w = torch.empty(t, h, d)
        kernels.DECODERS[mode](q, [sc.float() for sc in scales], w)
        out[half] = w
    return out


def _int4_nbytes(t: int, h: int, d: int, g: int) -> int:
    scales = 2 * 2 * (t // codec.group_size(t, g) * h * d + t * h * d // codec.group_size(d, g))
    return codec.HEADER_NBYTES + -(-scales // 64) * 64 + -(-(t * h * d) // 8) * 8 + 8


def _study(
    trips: Mapping[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]],
    T: int,
    H: int,
    D: int,
    dtype: torch.dtype,
    chunks: int,
    queries: int,
    seed: int,
) -> list[SchemeAccuracy]:
    rels: dict[str, list[torch.Tensor]] = {name: [] for name in trips}
    coss: dict[str, list[torch.Tensor]] = {name: [] for name in trips}
    for c in range(chunks):
        kv = realistic_kv(T, H, D, dtype, seed=seed + c)
        q = torch.randn(queries, H, D, generator=torch.Generator().manual_seed(10_000 + seed + c))
        ref = _attend(kv, q)
        for name, (trip, _) in trips.items():
            rel, cos = _compare(ref, _attend(trip(kv).to(dtype), q))
            rels[name].append(rel)
            coss[name].append(cos)
    rows = []
    for name, (_, nbytes) in trips.items():
        rel_all, cos_all = torch.cat(rels[name]), torch.cat(coss[name])
        rows.append(
            SchemeAccuracy(
                scheme=name,
                median_rel_err=float(rel_all.median()),
                p99_rel_err=float(torch.quantile(rel_all, 0.99)),
                mean_cosine=float(cos_all.mean()),
                min_cosine=float(cos_all.min()),
                size_ratio=nbytes / (4 * T * H * D),
            )
        )
    return rows


def _per_call(fn: Callable[[], object], samples: int = 7, min_s: float = 0.1) -> float:
    """Median seconds per call over ``samples`` runs of at least ``min_s`` each."""
    fn()
    times = []
    for _ in range(samples):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_s or calls == 0:
            fn()
            calls += 1
        times.append(elapsed / calls)
    return statistics.median(times)


def _decode_all(bufs: torch.Tensor, out: torch.Tensor, block_tokens: int) -> None:
    for i, buf in enumerate(bufs):
        codec.decode_chunk(buf, out=out[:, i * block_tokens : (i + 1) * block_tokens])


def measure_speed(
    tokens: int = 2048,
    block_tokens: int = 256,
    H: int = 8,
    D: int = 128,
    dtype: torch.dtype = torch.float16,
    quants: tuple[str, ...] = ("int8", "int8-kcc-vt", "int8-kc-vt", "int4", "none"),
) -> list[tuple[str, float, float]]:
    """Time the codec next to a plain ``dst.copy_(src)`` of the same bytes, on this CPU.

    Returns ``(what, GB/s, ms per call)`` rows; GB/s counts the unencoded KV bytes (the
    chunk bytes for ``verify_chunk``). The chunk is the non-contiguous slice
    ``layer[:, 256:512]`` of a ``tokens``-long layer; outputs are preallocated. Blocks
    for tens of seconds.
    """
    layer = realistic_kv(tokens, H, D, dtype, seed=1)
    n = tokens // block_tokens
    chunk = layer[:, block_tokens : 2 * block_tokens]
    keys = [codec.ChunkKey(bytes([i % 256]) * 16, 0, 0) for i in range(n)]
    chunk_dst, layer_dst = torch.empty_like(chunk), torch.empty_like(layer)
    size = chunk.numel() * chunk.element_size()
    jobs: list[tuple[str, int, Callable[[], object]]] = [
        ("copy_ chunk", size, partial(chunk_dst.copy_, chunk)),
        ("copy_ layer", n * size, partial(layer_dst.copy_, layer)),
    ]
    for q in quants:
        bufs = torch.empty(n, codec.chunk_nbytes(block_tokens, H, D, dtype, q), dtype=torch.uint8)
        codec.encode_blocks(layer, block_tokens, keys, q, out=bufs)
        jobs += [
            (f"encode_chunk {q}", size, partial(codec.encode_chunk, chunk, q, keys[1], bufs[1])),
            (f"decode_chunk {q}", size, partial(codec.decode_chunk, bufs[1], out=chunk_dst)),
            (f"encode_blocks {q}, layer", n * size,
             partial(codec.encode_blocks, layer, block_tokens, keys, q, bufs)),
            (f"decode_chunk x{n} {q}, layer", n * size,
             partial(_decode_all, bufs, layer_dst, block_tokens)),
        ]  # fmt: skip
    for kind in codec.CHECKSUMS:
        buf = codec.encode_chunk(chunk, "int8", checksum=kind)
        jobs.append((f"verify_chunk int8 {kind}", buf.numel(), partial(codec.verify_chunk, buf)))
    return [(what, nb / t / 1e9, t * 1e3) for what, nb, fn in jobs for t in [_per_call(fn)]]


def _main() -> None:
    parser = argparse.ArgumentParser(description="Compare the codec's INT8 schemes.")
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--H", type=int, default=8)
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--speed", action="store_true", help="time the codec instead")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.speed:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
        print("| operation | GB/s | ms per call |\n|---|---|---|")
        for what, gbps, ms in measure_speed(H=args.H, D=args.D, dtype=getattr(torch, args.dtype)):
            print(f"| {what} | {gbps:.2f} | {ms:.3f} |")
    else:
        _print_accuracy(args)


def _print_accuracy(args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    shape = (args.T, args.H, args.D, dtype, args.chunks, args.queries)
    rows = compare_schemes(*shape, schemes=(*(s for s in codec.SCHEMES if s != "raw"), "none"))
    print(
        f"T={args.T} H={args.H} D={args.D} {args.dtype}, {args.chunks} chunks x "
        f"{args.queries} queries x {args.H} heads; default int8 = {codec.DEFAULT_INT8}, "
        f"int4 = {codec.DEFAULT_INT4}"
    )
    _print_rows(rows)
    print("\nINT4 by group size G (K: groups of G tokens per channel, V: of G channels per token)")
    _print_rows(compare_int4_groups(T=args.T, H=args.H, D=args.D, dtype=dtype,
                                    chunks=args.chunks, queries=args.queries))  # fmt: skip


def _print_rows(rows: list[SchemeAccuracy]) -> None:
    print("| scheme | median rel. err | p99 rel. err | mean cosine | min cosine | size / fp16 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r.scheme}` | {100 * r.median_rel_err:.3f}% | {100 * r.p99_rel_err:.3f}% | "
            f"{r.mean_cosine:.6f} | {r.min_cosine:.6f} | {r.size_ratio:.4f} |"
        )


if __name__ == "__main__":
    _main()
