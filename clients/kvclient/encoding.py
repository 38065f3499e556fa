"""Starting a put's quantization so that it overlaps the caller and the network.

:func:`launch` returns an :class:`Encoded`: awaited with the rows to encode into (registered
``ucx://`` staging on the KV's own device, so a CUDA chunk is written from device memory
and never passes through the host) or None, it yields the chunks. The host and a GPU run
the same code; only the stream ordering below is CUDA's.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import torch

__all__ = ["Encoded", "launch"]

Encode = Callable[[torch.Tensor | None], list[torch.Tensor]]
"""Quantizes into the ``[N, chunk_bytes]`` rows it is given (or new ones) on the KV's
device; returns the N chunks."""


class Encoded:
    """A started encode of KV on ``device``: ``await encoded(rows)`` runs it into ``rows``
    (None: new rows on ``device``) and yields the chunks, on ``device``.

    CUDA: at :func:`launch` an event is recorded on the caller's current stream, from the
    caller's thread, so the encode reads the KV only once every kernel the caller queued
    before the put has run; the encode runs on the client's codec thread on a side stream
    that waits for that event (never a device-wide sync), and the chunks are returned once
    its own event has completed, before any transfer reads them. The caller must not queue
    writes of the KV until the put ends (as on the host).
    """

    def __init__(
        self, device: torch.device, encode: Encode, run_codec: Callable[..., Awaitable[Any]]
    ) -> None:
        self.device = device
        self._encode = encode
        self._run_codec = run_codec
        self._ready: Any = None
        if device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))

    async def __call__(self, rows: torch.Tensor | None) -> list[torch.Tensor]:
        return await self._run_codec(self._run, rows)  # type: ignore[no-any-return]

    def _run(self, rows: torch.Tensor | None) -> list[torch.Tensor]:
        if self._ready is None:
            return self._encode(rows)
        stream = _side_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self._ready)
            chunks = self._encode(rows)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return chunks


_local = threading.local()


def _side_stream(device: torch.device) -> Any:
    """The calling thread's side stream on ``device`` (one per codec thread and device,
    gone with the thread)."""
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


def launch(
    device: torch.device, encode: Encode, run_codec: Callable[..., Awaitable[Any]]
) -> Encoded:
    """Start encoding KV that lives on ``device`` (see :class:`Encoded`); ``run_codec``
    runs a function on the client's codec thread."""
    return Encoded(device, encode, run_codec)
