"""A pool client that lets its engine start while the pool is down (fail open).

An engine's connector must never take the engine down: vLLM builds its connector while the
engine starts, and a constructor that raises stops the engine. :class:`PoolLink` is a
:class:`~kvclient.SyncKVClient` that is not there yet: it tries to connect once when made,
and if the pool does not answer it logs one warning and keeps trying on a thread of its own
(``kvclient-connect``), with backoff from ``retry_s`` doubling up to ``max_retry_s``, each
try bounded by ``timeout_s``; the thread ends once connected or closed, so nothing outlives
:meth:`close`. Until then every call raises :class:`NotConnected` (an
:class:`~kvstore.errors.Unreachable`) at once, which the connector answers by computing:
the scheduler matches nothing, the worker saves and loads nothing. The namespace is local
(``link.ns``) and needs no pool.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from kvstore.core.hashing import Namespace
from kvstore.errors import KVStoreError, Unreachable

from .sync import SyncKVClient

__all__ = ["NotConnected", "PoolLink"]

logger = logging.getLogger("kvclient.lazy")


def _uses_cuda(device: Any) -> bool:
    """Whether a warm-up for ``device`` would make CUDA calls that must not race an
    engine's CUDA graph capture: ``device`` is a GPU, or this process initialised CUDA."""
    try:
        if device is not None and torch.device(device).type == "cuda":
            return True
    except (RuntimeError, TypeError):
        return False  # (not a device: the warm-up says so)
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class NotConnected(Unreachable):
    """The pool has not answered since the engine started; the call was not tried."""


class PoolLink:
    """A :class:`~kvclient.SyncKVClient` to ``master`` once the pool answers (see the
    module docstring). ``options`` go to :meth:`SyncKVClient.connect`; each try, the one in
    the constructor included, is bounded by its ``timeout_s`` (a refused connection fails
    at once)."""

    def __init__(
        self,
        master: str,
        ns: Namespace,
        *,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        **options: Any,
    ) -> None:
        self.master, self.ns = master, ns
        self._options = options
        self._retry_s, self._max_retry_s = retry_s, max_retry_s
        self._client: SyncKVClient | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._warm: tuple[Any] | None = None  # (device,) of a warm-up asked for
        self._warming: threading.Thread | None = None
        try:
            self._try()
        except KVStoreError as exc:
            logger.warning(
                "kvstore pool at %s is unreachable or refused us (%s): the engine computes "
                "every prompt until it answers; retrying in the background every %g-%g s",
                master, exc, retry_s, max_retry_s,
            )  # fmt: skip
            self._thread = threading.Thread(
                target=self._retry, name="kvclient-connect", daemon=True
            )
            self._thread.start()

    @property
    def connected(self) -> bool:
        """Whether the pool has answered (calls now go to it)."""
        return self._client is not None

    def client(self) -> SyncKVClient:
        """The connected client; raises :class:`NotConnected` before the pool answered."""
        client = self._client
        if client is None:
            raise NotConnected(f"kvstore pool at {self.master} not connected yet (retrying)")
        return client

    def __getattr__(self, name: str) -> Any:  # the client's calls, once connected
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.client(), name)

    def warm_up(self, device: Any = None) -> None:
        """:meth:`~kvclient.SyncKVClient.warm_up` for ``device`` (where the engine's KV
        lives), never raising: a failure is logged, and the first transfers then pay for
        what it did not do.

        Where the process uses CUDA (``device`` a GPU, or CUDA initialised) it runs now,
        on the caller's thread and bounded by the client's ``timeout_s``, and only if the
        pool has answered: an engine captures CUDA graphs after it registers its caches,
        and a capture fails on CUDA calls from another thread (the staging's pinned or
        device memory, its registration). Otherwise it runs in the background and this
        returns at once: on a thread of its own (``kvclient-warm``) once connected, else
        on the connecting thread right after the pool answers. One at a time: a call
        while one runs is dropped."""
        if _uses_cuda(device):
            client = self._client
            if client is None:
                logger.info("kvstore pool not connected yet: no warm-up on this CUDA process")
                return
            self._warm_up(client, device)
            return
        with self._lock:
            if self._closed.is_set() or self._warming is not None:
                return
            client = self._client
            if client is None:
                self._warm = (device,)  # (the connecting thread warms it up)
                return
            self._warming = threading.Thread(
                target=self._warm_up, args=(client, device), name="kvclient-warm", daemon=True
            )
            self._warming.start()

    def _warm_up(self, client: SyncKVClient, device: Any) -> None:
        try:
            ready = client.warm_up(device)  # type: ignore[attr-defined]
        except KVStoreError as exc:
            logger.warning("kvstore warm-up failed (%s): the first transfers pay for it", exc)
        except Exception:  # (not ours: logged all the same, the engine goes on)
            logger.warning("kvstore warm-up failed: the first transfers pay for it", exc_info=True)
        else:
            logger.info("kvstore warm-up done: ucx:// ready to %d node(s)", len(ready))
        finally:
            with self._lock:
                if self._warming is threading.current_thread():
                    self._warming = None

    def _try(self) -> None:
        client = SyncKVClient.connect(self.master, self.ns, **self._options)
        with self._lock:
            if self._closed.is_set():  # closed while connecting: nobody will use it
                client.close()
                return
            self._client, warm, self._warm = client, self._warm, None
            if warm is not None:
                self._warming = threading.current_thread()
        if warm is not None:  # (asked for before the pool answered)
            self._warm_up(client, *warm)

    def _retry(self) -> None:
        delay = self._retry_s
        while not self._closed.wait(delay):
            try:
                self._try()
            except KVStoreError as exc:
                logger.debug("kvstore pool at %s still unreachable: %s", self.master, exc)
                delay = min(delay * 2, self._max_retry_s)
                continue
            if self._client is not None:
                logger.warning("kvstore pool at %s answers: using it from now on", self.master)
            return

    def close(self) -> None:
        """Stop trying and close the client, if any; idempotent."""
        with self._lock:
            self._closed.set()
            client, self._client = self._client, None
        wait = float(self._options.get("timeout_s", 10.0)) + 5
        for thread in (self._thread, self._warming):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=wait)
        if client is not None:
            client.close()
