"""Run pytest with a Redis for the Redis tests: ``make test``'s last step.

    python scripts/pytest_redis.py [PYTEST ARGS]

The Redis tests (index store, ``kvstore master --redis``) read ``KVSTORE_TEST_REDIS`` (a
``redis://`` URL) and skip without it. This wrapper:

- with ``KVSTORE_TEST_REDIS`` set (``.ci/run`` sets it), runs pytest against that Redis;
- else, with ``redis-server`` on ``PATH``, starts a throwaway one on a free loopback port
  (no persistence, a temporary directory), waits for its PONG (at most 10 s), runs pytest
  with ``KVSTORE_TEST_REDIS`` pointing at it and stops it afterwards — also when pytest
  fails or is interrupted;
- else runs pytest and then says loudly, on stderr, how many tests were skipped for want
  of a Redis (counted from pytest's ``-rs`` skip summary) and how to run them.

The exit status is pytest's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

REDIS_ENV = "KVSTORE_TEST_REDIS"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
_SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] .*" + REDIS_ENV)


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping(port: int) -> bool:
    """True if a Redis answers PING on ``127.0.0.1:port`` within 0.5 s."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def throwaway_redis(server: str) -> Iterator[str]:
    """A ``redis-server`` on a free loopback port for the block; yields its URL."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvstore-redis-") as tmp:
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp, "--logfile", os.path.join(tmp, "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not ping(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {port}")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)


def run_pytest(args: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Run pytest (output passed through as it comes); returns (its exit status, tests
    skipped for want of ``KVSTORE_TEST_REDIS``)."""
    cmd = [sys.executable, "-m", "pytest", "-rs", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None
    skipped = 0
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            match = _SKIP_LINE.match(line)
            if match:
                skipped += int(match.group(1))
        return proc.wait(), skipped
    except BaseException:  # interrupted or terminated: stop pytest too, then clean up
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
        raise


def main(args: list[str]) -> int:
    # SIGTERM (make or CI killed) unwinds like Ctrl-C, so the throwaway Redis is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    env = dict(os.environ)
    if env.get(REDIS_ENV):
        return run_pytest(args, env)[0]
    server = shutil.which("redis-server")
    if server is not None:
        with throwaway_redis(server) as url:
            print(f"pytest_redis: throwaway redis-server at {url}", flush=True)
            return run_pytest(args, {**env, REDIS_ENV: url})[0]
    status, skipped = run_pytest(args, env)
    bar = "!" * 78
    print(
        f"\n{bar}\n!! {skipped} Redis tests were SKIPPED: no redis-server on PATH and "
        f"{REDIS_ENV} unset.\n!! Install redis-server (apt-get install redis-server) or set "
        f"{REDIS_ENV}=redis://HOST:PORT/DB.\n{bar}",
        file=sys.stderr,
        flush=True,
    )
    return status


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
