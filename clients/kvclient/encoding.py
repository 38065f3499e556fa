"""Starting a put's quantization so that it overlaps the caller and the network.

:func:`launch` returns an :data:`Encoded`: a coroutine function that, awaited with the rows
to encode into (registered ``ucx://`` staging) or None, yields the host chunks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch

__all__ = ["Encoded", "launch"]

Encoded = Callable[[torch.Tensor | None], Awaitable[list[torch.Tensor]]]
"""A started encode: awaited with staging rows (or None), yields the host chunks."""


def launch(
    on_cuda: bool,
    encode: Callable[[torch.Tensor | None], list[torch.Tensor]],
    run_codec: Callable[..., Awaitable[Any]],
) -> Encoded:
    """Start ``encode``; the returned coroutine function yields the host chunks, written
    into the ``[N, chunk_bytes]`` rows it is given (registered staging) when not None.

    CUDA: the kernels are queued now, from the calling thread on its current stream, and
    an event is recorded after them; the coroutine waits on that event (off the loop, by
    ``run_codec``), never on a device-wide sync, then copies the chunks to the host once.
    CPU: the coroutine runs ``encode`` through ``run_codec`` (the client's codec thread),
    straight into the rows.
    """
    if on_cuda:
        chunks = encode(None)
        event = torch.cuda.Event()
        event.record()

        async def after_event(rows: torch.Tensor | None) -> list[torch.Tensor]:
            await run_codec(event.synchronize)
            if rows is None:
                return [c.cpu() for c in chunks]
            for row, c in zip(rows.unbind(0), chunks, strict=True):
                row.copy_(c)
            return list(rows.unbind(0))

        return after_event

    async def on_codec_thread(rows: torch.Tensor | None) -> list[torch.Tensor]:
        return await run_codec(encode, rows)  # type: ignore[no-any-return]

    return on_codec_thread
