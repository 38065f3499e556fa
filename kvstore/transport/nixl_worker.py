"""The NIXL agent's worker thread: jobs run in order from a ``SimpleQueue`` (see
:mod:`kvstore.transport.nixl`)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Done", "Job", "Worker"]

logger = logging.getLogger("kvstore.transport.nixl")

Done = Callable[[Any, "BaseException | None"], None]


@dataclass(eq=False)
class Job:
    """One call for the worker thread; ``done(result, exc)`` runs there when it returns.
    ``skip()`` true when its turn comes (its caller gave up) drops it unrun."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: Done
    skip: Callable[[], bool] | None = None

    def run(self) -> None:
        """Call ``fn`` (unless skipped), then ``done``; never raises."""
        if self.skip is not None and self.skip():
            return
        outcome: tuple[Any, BaseException | None]
        try:
            outcome = (self.fn(*self.args), None)
        except BaseException as exc:
            outcome = (None, exc)
        try:
            self.done(*outcome)
        except Exception:  # never let one caller's callback stop the thread
            logger.exception("NIXL worker: a job's completion callback failed")


class Worker:
    """The agent's one thread: runs :class:`Job` s in order from a ``SimpleQueue`` and
    stops after the jobs queued before :meth:`stop`. With ``idle``, calls it each time no
    job came for ``idle_s`` seconds. A daemon, so a hung NIXL call cannot hold up
    interpreter exit."""

    def __init__(
        self, name: str, idle: Callable[[], None] | None = None, idle_s: float = 0.05
    ) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._idle = idle
        self._idle_s = idle_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; never blocks."""
        self._jobs.put(job)

    def stop(self) -> None:
        """Let the thread exit once the jobs already queued have run; never blocks."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s if self._idle else None)
            except queue.Empty:  # (only with ``idle``: no job for idle_s)
                assert self._idle is not None
                try:
                    self._idle()
                except Exception:  # never let the idle call stop the thread
                    logger.exception("NIXL worker: the idle call failed")
                continue
            if job is None:
                return
            job.run()
