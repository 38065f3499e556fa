"""Non-blocking operations: :class:`Handle`, :class:`Result`, and the event-loop thread.

An engine's forward pass must never wait on the network, so ``start_put_layer`` and
``start_get_layer`` return a :class:`Handle` at once; the work runs as a task on the
client's event loop. A handle can be waited on from any thread except that loop's
(``wait``), awaited from the loop (``await handle``), polled (``done``) and cancelled from
anywhere (``cancel``). Cancelling waits, boundedly, until the task has finished its
cleanup, so when ``cancel()`` returns the pins and holds the operation took on the nodes are
released (the node releases a pin when the exchange's connection closes).

Failures that concern only some blocks are data, not exceptions: :class:`Result.missing`
lists the (block index, layer) pairs that could not be stored or loaded.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstore.errors import Cancelled, Closed, InvalidArgument, KVStoreError, KVTimeout

__all__ = [
    "Handle",
    "LoopThread",
    "Result",
    "StreamHandle",
    "all_of",
    "prefix_len",
    "shared_loop",
]

T = TypeVar("T")

_CANCEL_WAIT_S = 10.0  # how long cancel() waits for a task's cleanup


@dataclass(frozen=True)
class Result:
    """What a finished put or get did.

    ``tokens``: tokens stored or loaded (for a get: the blocks loaded, holes excluded;
    for a put: the leading blocks stored). ``missing``: ``(block index, layer)`` pairs that
    could not be stored or loaded — recompute exactly those.
    """

    tokens: int
    missing: list[tuple[int, int]] = field(default_factory=list)


class Handle:
    """A running operation. Thread-safe; see the module docstring for the contract."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, start: Callable[[], Coroutine[Any, Any, Any]]
    ) -> None:
        """Run ``start()`` as a task on ``loop``; the coroutine is created only inside the
        task, so a handle cancelled before it ran leaves nothing unawaited."""
        self._loop = loop
        self._finished = threading.Event()
        self._future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if _in_loop(loop):
            self._task: asyncio.Task[Any] | None = loop.create_task(self._run(start))
        else:
            self._task = None
            self._cf = asyncio.run_coroutine_threadsafe(self._run(start), loop)

    async def _run(self, start: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        try:
            result = await start()
        except asyncio.CancelledError:
            self._future.set_exception(Cancelled("the operation was cancelled"))
        except BaseException as exc:
            self._future.set_exception(exc)
        else:
            self._future.set_result(result)
        finally:
            self._finished.set()

    def done(self) -> bool:
        """True once the operation finished (succeeded, failed or was cancelled)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finishes and return its :class:`Result`.

        Must not be called on the client's event-loop thread (``await`` the handle
        there). Raises :class:`KVTimeout` when ``timeout`` passes first (the operation goes
        on; cancel it if it is no longer wanted), :class:`Cancelled` after ``cancel``, or
        the operation's own error.
        """
        if _in_loop(self._loop):
            raise InvalidArgument("Handle.wait() on the event-loop thread would deadlock; await it")
        if not self._finished.wait(timeout):
            raise KVTimeout(f"operation still running after {timeout} s")
        return self._future.result()

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.wrap_future(self._future, loop=self._loop).__await__()

    def cancel(self) -> bool:
        """Cancel the operation and wait (at most 10 s off the loop thread) until its
        cleanup ran. False if it had already finished."""
        if self._finished.is_set():
            return False
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        else:
            self._loop.call_soon_threadsafe(self._cf.cancel)
        if not _in_loop(self._loop):
            self._finished.wait(_CANCEL_WAIT_S)
        return True


class StreamHandle(Handle):
    """A running ``stream_layers``: :meth:`layer` blocks until one layer has arrived.

    The layers arrive in order; ``wait()`` returns a :class:`Result` once all arrived.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        num_layers: int,
        run: Callable[[Callable[[int, Any], None]], Awaitable[Any]],
    ) -> None:
        self._layers: list[Any] = [None] * num_layers
        self._arrived = [threading.Event() for _ in range(num_layers)]

        def deliver(layer: int, tensor: Any) -> None:
            self._layers[layer] = tensor
            self._arrived[layer].set()

        async def body() -> Any:
            return await run(deliver)

        super().__init__(loop, body)

    def layer(self, layer: int, timeout: float | None = None) -> Any:
        """Block until ``layer`` has arrived and return its ``[2, n, H, D]`` tensor.

        Raises :class:`KVTimeout` after ``timeout``, or the stream's error (a
        :class:`~kvstore.errors.Miss` naming the layer) if it failed before that layer.
        """
        if not 0 <= layer < len(self._layers):
            raise InvalidArgument(f"layer {layer} outside [0, {len(self._layers)})")
        event = self._arrived[layer]
        if _in_loop(self._loop):
            raise InvalidArgument("StreamHandle.layer() on the event-loop thread would deadlock")
        waited = 0.0
        step = 0.05
        while not event.is_set():
            if self._finished.is_set() and not event.is_set():
                self._future.result()  # raises the stream's error
                raise KVStoreError(f"stream ended without layer {layer}")
            if timeout is not None and waited >= timeout:
                raise KVTimeout(f"layer {layer} did not arrive within {timeout} s")
            event.wait(step)
            waited += step
        return self._layers[layer]


async def all_of(n: int) -> set[int]:
    """The put or get that needs no I/O: blocks ``0 .. n-1`` are done already."""
    return set(range(n))


def prefix_len(present: set[int], n: int) -> int:
    """How many leading indices ``0, 1, ...`` (below ``n``) are in ``present``."""
    m = 0
    while m < n and m in present:
        m += 1
    return m


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class LoopThread:
    """One event loop on a daemon thread, shared by every sync client of the process.

    Created on first use (:func:`shared_loop`); not fork-safe: a child process that
    inherited it gets a fresh one (clients must be created after the fork).
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._main, name="kvclient-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and block for its result, at most ``timeout`` seconds
        (then the coroutine is cancelled and :class:`KVTimeout` raised)."""
        if _in_loop(self.loop):
            coro.close()
            raise InvalidArgument("a sync client method was called on its own event-loop thread")
        if not self.alive:  # stopped at exit: nothing would ever run it
            coro.close()
            raise Closed("the kvclient event loop has stopped (the interpreter is exiting)")
        cf = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return cf.result(timeout)
        except KVStoreError:
            raise  # the call's own error (its KVTimeout too: that is a TimeoutError as well)
        except concurrent.futures.TimeoutError as exc:
            cf.cancel()
            raise KVTimeout(f"call did not complete within {timeout} s") from exc
        except concurrent.futures.CancelledError:
            raise Closed("the call was cancelled: its client was closed") from None

    @property
    def alive(self) -> bool:
        """Whether the loop still runs calls (False once stopped at exit)."""
        return self._thread.is_alive() and not self.loop.is_closed()

    def stop(self) -> None:
        """Stop the loop and join the thread (at exit)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


_shared: LoopThread | None = None
_shared_lock = threading.Lock()


def shared_loop() -> LoopThread:
    """The process-wide loop thread of the sync clients (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.pid != os.getpid():
            _shared = LoopThread()
            atexit.register(_shared.stop)
        return _shared
