"""Drive one real vLLM instance in its own OS process (``tests/engines/vllm_serve.py``
under ``.venv-vllm``) from the test suite or a benchmark: start it, send requests, read
answers, stop it. Every wait is bounded."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
SERVE = ROOT / "tests" / "engines" / "vllm_serve.py"
START_S = 300.0  # a vLLM start takes ~15-45 s on 2 cores; a loaded CI machine more


def kv_config(role: str, master: str, quant: str = "none", **extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for kvstore's connector."""
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvclient.vllm_connector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "master": master, "block_tokens": 64, "quant": quant, "timeout_s": 10, **extra,
        },
    }  # fmt: skip


class VLLM:
    """A vLLM instance serving ``model`` (a checkpoint directory) with ``block_size``;
    ``kv``: a :func:`kv_config` (None: plain vLLM). ``options`` go to vllm_serve.py's
    config (``max_num_batched_tokens``, ``dtype``, ...). ``wait=False`` returns once the
    process is started (several instances then start side by side): call :meth:`ready`."""

    def __init__(self, model: str, block_size: int, kv: dict[str, Any] | None = None,
                 *, wait: bool = True, **options: Any) -> None:  # fmt: skip
        config = {"model": model, "block_size": block_size, "kv": kv, **options}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(SERVE), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            cwd=str(ROOT),
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._ready = False
        if wait:
            self.ready()

    def ready(self) -> VLLM:
        """Wait until the engine is up (at most ``START_S``); returns ``self``."""
        if not self._ready:
            first = self._next(START_S)
            if not first.get("ready"):
                raise RuntimeError(f"vLLM did not start: {first}\n{self.tail()}")
            self._ready = True
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from vLLM within {timeout} s\n{self.tail()}") from None
        if line is None:
            raise RuntimeError(f"vLLM exited (rc {self.proc.poll()})\n{self.tail()}")
        return dict(json.loads(line))

    def send(self, rid: str, prompt: list[int], max_tokens: int = 16, **job: Any) -> None:
        """Queue a request (answers come in order: :meth:`answer`)."""
        assert self.proc.stdin is not None
        line = {"id": rid, "prompt": prompt, "max_tokens": max_tokens, **job}
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 180.0) -> dict[str, Any]:
        """The next answer; raises on an error answer, a timeout or an exit."""
        got = self._next(timeout)
        if "error" in got:
            raise RuntimeError(f"vLLM failed request {got['id']}: {got['error']}\n{self.tail()}")
        return got

    def ask(self, rid: str, prompt: list[int], max_tokens: int = 16, **job: Any) -> dict[str, Any]:
        self.send(rid, prompt, max_tokens, **job)
        return self.answer()

    def tail(self, n: int = 4000) -> str:
        """The end of the instance's log (vLLM's own output)."""
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """Close stdin: the instance exits when it has answered everything (:meth:`close`
        waits for it; stopping several first lets them exit side by side)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self) -> int:
        """Close stdin (the instance exits), bounded; returns its exit code."""
        try:
            self.stop()
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
        finally:
            self.log.close()
            os.unlink(self.log.name)

    def __enter__(self) -> VLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reference_engine(role: str, model: str, master: str, prompts: list[list[int]],
                     max_new: int = 16, quant: str = "none") -> list[dict[str, Any]]:  # fmt: skip
    """Run ``python -m examples.reference_engine ROLE --model DIR`` (this environment's
    transformers) against the pool; its JSON lines."""
    out = subprocess.run(
        [sys.executable, "-m", "examples.reference_engine", role, "--model", model,
         "--master", master, "--quant", quant, "--block-tokens", "64",
         "--prompts", json.dumps(prompts), "--max-new", str(max_new)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"reference engine {role} failed:\n{out.stderr[-4000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
