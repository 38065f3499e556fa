"""Starting a put's quantization so that it overlaps the caller and the network.

:func:`launch` returns an :class:`Encoded`: awaited with the rows the chunks must end in
(registered ``ucx://`` staging, on the KV's own device where it could be registered: a
CUDA chunk then never passes through the host) or None, it yields the chunks.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

__all__ = ["Encoded", "copy_rows", "launch"]

Encode = Callable[[torch.Tensor | None], list[torch.Tensor]]
"""Quantizes into the ``[N, chunk_bytes]`` rows it is given (or new ones) on the KV's
device; returns the N chunks."""


class Encoded:
    """A started encode of KV on ``device``: ``await encoded(rows)`` yields the chunks, in
    ``rows`` when given (None: wherever the encode put them, on ``device``).

    Host KV: the encode runs when awaited, straight into ``rows``: on the loop when its
    ``nbytes`` of chunks are few (a hand-off to the codec thread and back cost more than
    such an encode), else on the client's codec thread. CUDA KV: the kernels are queued at
    :func:`launch`, from the caller's thread on its current stream, into new device rows,
    and an event is recorded after them; so the encode reads the KV after every kernel the
    caller queued before the put and before any it queues after (the cache blocks may be
    reused at once: a preempted request's are). Awaited, the chunks are copied into ``rows``
    on a side stream that waits for that event (a device-to-device copy when ``rows`` is the
    GPU's registered staging), and returned once it completed, before any transfer reads
    them; never a device-wide sync. (The launch returns once the caller's stream reached the
    encode: the codec reads one flag back to refuse non-finite KV.)
    """

    def __init__(
        self,
        device: torch.device,
        encode: Encode,
        run_codec: Callable[..., Awaitable[Any]],
        nbytes: int,
    ) -> None:
        self.device = device
        self._encode = encode
        self._run_codec = run_codec
        self._nbytes = nbytes if device.type == "cpu" else None
        self._chunks: list[torch.Tensor] = []
        self._event: Any = None
        if device.type == "cuda":
            self._chunks = encode(None)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    async def __call__(self, rows: torch.Tensor | None) -> list[torch.Tensor]:
        return await self._run_codec(self._nbytes, self._run, rows)  # type: ignore[no-any-return]

    def _run(self, rows: torch.Tensor | None) -> list[torch.Tensor]:
        if self._event is None:
            return self._encode(rows)
        chunks, self._chunks = self._chunks, []  # (the device rows go once copied)
        if rows is None:
            self._event.synchronize()
            return chunks
        return copy_rows(rows, chunks, self._event)


def copy_rows(
    rows: torch.Tensor, chunks: Sequence[torch.Tensor], after: Any = None
) -> list[torch.Tensor]:
    """Copy ``chunks[i]`` into ``rows[i]`` (any devices) and return the rows once the copies
    are done, so a transfer may read them; on CUDA on a side stream of the calling thread
    that first waits for the event ``after`` (if given). Runs on the codec thread, or on the
    loop for a few host rows."""
    out = list(rows.unbind(0))
    cuda = [t.device for t in (rows, chunks[0]) if t.device.type == "cuda"]
    if not cuda:
        for row, chunk in zip(out, chunks, strict=True):
            row.copy_(chunk)
        return out
    stream = _side_stream(cuda[0])
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        for row, chunk in zip(out, chunks, strict=True):
            row.copy_(chunk, non_blocking=True)
    stream.synchronize()
    return out


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
    device: torch.device, encode: Encode, run_codec: Callable[..., Awaitable[Any]], nbytes: int
) -> Encoded:
    """Start encoding KV that lives on ``device`` (see :class:`Encoded`) into ``nbytes`` of
    chunks; ``run_codec(nbytes, fn, *args)`` runs it
    (:meth:`~kvclient.KVClient._run_codec`: host work that small on the loop, the rest on
    the client's codec thread)."""
    return Encoded(device, encode, run_codec, nbytes)
