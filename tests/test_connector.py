"""The vLLM-shaped connector driven through the call sequence vLLM V1's scheduler and
worker make (``vllm/v1/core/sched/scheduler.py``, ``kv_connector_model_runner_mixin.py``),
against a real ``kvstore serve``: a chunked prefill saving layer by layer, a decode
loading layer by layer (with and without the engine's own prefix hit), a block evicted
between match and load (reported by engine block id, never left as zeros), an aborted
request, and no pin left behind.

vLLM is not installed here: its ``Request``, ``KVCacheBlocks`` and ``SchedulerOutput`` are
stood in for by objects with the attributes the connector reads (the engine is not our
code); the connector, the client and the server are the real ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvclient.vllm_connector import KVStoreConnector
from kvstore.dataplane import NodeClient
from tests import cluster, pageforms
from tests.cluster import TRANSPORTS, Server, rpc_count, serving

pytestmark = pytest.mark.slow

L, H, D, B, BS = 3, 2, 16, 16, 4  # layers, KV heads, head dim, our block, engine block
NUM_BLOCKS = 96
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
SENTINEL = -3.0


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    with serving("64MiB", request.param) as srv:
        yield srv


# ----------------------------------------------------------------------------- vLLM's side


def attention_layer(form: str) -> SimpleNamespace:
    """A vLLM attention layer as the connector reads it: its backend's name, the CPU
    backend's ISA, and the impl's cache write (the engine's own indexing)."""
    write = pageforms.writer(form)
    backend = pageforms.BACKEND[form]
    return SimpleNamespace(
        attn_backend=SimpleNamespace(get_name=lambda: backend),
        isa=pageforms.ISA.get(form),
        impl=SimpleNamespace(do_kv_cache_update=lambda layer, k, v, cache, slots: write(
            k, v, cache, slots)),
    )  # fmt: skip


def vllm_config(master: str, kv_role: str, model: str, form: str = "kv_first") -> SimpleNamespace:
    model_config = SimpleNamespace(
        model=model, revision="r1", dtype=torch.bfloat16,
        get_num_layers=lambda parallel: L, get_num_kv_heads=lambda parallel: H,
        get_head_size=lambda: D,
    )  # fmt: skip
    return SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, rank=0),
        cache_config=SimpleNamespace(block_size=BS),
        compilation_config=SimpleNamespace(
            static_forward_context={name: attention_layer(form) for name in LAYER_NAMES}
        ),
        kv_transfer_config=SimpleNamespace(
            kv_role=kv_role,
            kv_connector_extra_config={
                "master": master,
                "block_tokens": B,
                "quant": "none",
                "timeout_s": 10,
                "hold_s": 30,
            },
        ),
    )


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: Any = field(default_factory=lambda: SimpleNamespace(name="RUNNING"))


@dataclass
class Blocks:  # KVCacheBlocks
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[Any] = field(default_factory=list)
    scheduled_cached_reqs: Any = field(
        default_factory=lambda: SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[]
        )
    )
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)


def new_req(req: Request, blocks: list[int], computed: int, scheduled: int) -> SchedulerOutput:
    new = SimpleNamespace(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                          block_ids=(blocks,), num_computed_tokens=computed)  # fmt: skip
    return SchedulerOutput([new], num_scheduled_tokens={req.request_id: scheduled})


def cached_req(
    req: Request, new_blocks: list[int], computed: int, scheduled: int
) -> SchedulerOutput:
    cached = SimpleNamespace(req_ids=[req.request_id], new_block_ids=[(new_blocks,)],
                             num_computed_tokens=[computed])  # fmt: skip
    return SchedulerOutput([], cached, {req.request_id: scheduled})


def layer_kv(tokens: list[int], layer: int) -> torch.Tensor:
    """What the 'model' computes for ``tokens`` at ``layer``: [2, T, H, D], deterministic."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1, 1)
    pos = torch.arange(len(tokens), dtype=torch.float32).view(1, -1, 1, 1)
    ch = torch.arange(H * D, dtype=torch.float32).view(1, 1, H, D)
    kv = torch.sin(t * 0.013 + pos * 0.07 + ch * 0.011 + layer) * 3
    return torch.cat([kv, -kv]).to(torch.bfloat16)


class Engine:
    """One engine instance: a paged cache per layer in page form ``form`` and the
    worker-side connector, stepped the way vLLM's model runner steps it. The "model"
    writes and the test reads each token through the engine's own indexing."""

    def __init__(self, master: str, kv_role: str, model: str, form: str = "kv_first") -> None:
        cfg = vllm_config(master, kv_role, model, form)
        self.form = form
        self.sched = KVStoreConnector(cfg, SimpleNamespace(name="SCHEDULER"), None)
        self.work = KVStoreConnector(cfg, SimpleNamespace(name="WORKER"), None)
        self.caches = {
            name: pageforms.new(form, NUM_BLOCKS, BS, H, D, torch.bfloat16, SENTINEL)
            for name in LAYER_NAMES
        }
        self.work.register_kv_caches(self.caches)

    def step(
        self, out: SchedulerOutput, compute: dict[str, tuple[list[int], list[int], int, int]]
    ) -> Any:
        """Scheduler's build_connector_meta, then the worker's execute_model with the
        connector's context: bind, start_load_kv, per layer wait/compute/save, wait_for_save,
        get_finished, get_block_ids_with_load_errors, clear. ``compute``: request id ->
        (prompt, block ids, first token, end token) the forward pass computes."""
        meta = self.sched.build_connector_meta(out)
        self.work.bind_connector_metadata(meta)
        self.work.start_load_kv(None)
        for i, (name, cache) in enumerate(self.caches.items()):
            self.work.wait_for_layer_load(name)
            for prompt, blocks, lo, hi in compute.values():
                kv = layer_kv(prompt, i)
                for t in range(lo, hi):
                    slot = blocks[t // BS] * BS + t % BS
                    pageforms.write(self.form, cache, slot, kv[0, t], kv[1, t])
            self.work.save_kv_layer(name, cache, None)
        self.work.wait_for_save()
        finished = self.work.get_finished(out.finished_req_ids)
        errors = self.work.get_block_ids_with_load_errors()
        self.work.clear_connector_metadata()
        return meta, finished, errors

    def tokens(self, layer: int, blocks: list[int], n: int) -> torch.Tensor:
        """[2, n, H, D]: the first ``n`` tokens of ``blocks`` as the engine reads them."""
        cache = self.caches[LAYER_NAMES[layer]]
        pairs = [pageforms.read(self.form, cache, blocks[t // BS] * BS + t % BS) for t in range(n)]
        return torch.stack([torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])])

    def fill(self, blocks: list[int]) -> None:
        full = torch.full((H, D), SENTINEL, dtype=torch.bfloat16)
        for cache in self.caches.values():
            for b in blocks:
                for n in range(BS):
                    pageforms.write(self.form, cache, b * BS + n, full, full)

    def close(self) -> None:
        self.work.shutdown()
        self.sched.shutdown()


def drain_finished(engine: Engine, ids: set[str]) -> set[str]:
    """Empty steps (vLLM steps while delayed frees remain) until ``ids`` are reported."""
    sent: set[str] = set()
    for _ in range(200):
        _, (done, _), _ = engine.step(SchedulerOutput(finished_req_ids=ids - sent), {})
        sent |= done or set()
        if sent >= ids:
            return sent
        time.sleep(0.05)
    return sent


# ----------------------------------------------------------------------------- the test


@pytest.mark.parametrize(
    ("pform", "dform"),
    [("kv_first", "kv_first"), ("bhnc_nhd", "bhnc_nhd"), ("cpu_dn", "bhnc_hnd"),
     ("bhnc_nhd", "cpu_dn")],
)  # fmt: skip
def test_vllm_call_sequence_prefill_decode_load_error_and_abort(
    server: Server, pform: str, dform: str
) -> None:
    """Prefill and decode may keep different page forms (another backend or CPU ISA):
    the decode reads the prefill's K and V, token by token."""
    layout = pform + dform
    prompt = [(7 * i + 3 + len(layout)) % 5000 for i in range(100)]  # 6 whole blocks of ours
    blocks = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 26, -1))  # 25 engine blocks, reversed
    model = f"connector-{server.data}"
    prefill = Engine(server.grpc, "kv_producer", model, pform)
    decode = Engine(server.grpc, "kv_consumer", model, dform)
    try:
        # --- prefill instance: a chunked prefill of 64, then 36 tokens, then finished.
        p1 = Request("p1", prompt)
        assert prefill.sched.get_num_new_matched_tokens(p1, 0) == (0, False)  # producer only
        prefill.sched.update_state_after_alloc(p1, Blocks(blocks), 0)
        meta, _, errors = prefill.step(
            new_req(p1, blocks[:16], 0, 64), {"p1": (prompt, blocks, 0, 64)}
        )
        assert [s.skip_tokens for s in meta.meta.saves] == [0] and not meta.meta.loads
        assert errors == set()
        meta, _, _ = prefill.step(
            cached_req(p1, blocks[16:], 64, 36), {"p1": (prompt, blocks, 64, 100)}
        )
        assert [(s.skip_tokens, len(s.token_ids)) for s in meta.meta.saves] == [(64, 96)]
        p1.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        p1.output_token_ids = [42]  # its first (and, length-capped at 1, only) token
        delay, params = prefill.sched.request_finished(p1, blocks)
        assert delay is True
        assert params == {"kvstore": {"prompt_tokens": 100, "saved_tokens": 96, "first_token": 42}}
        assert drain_finished(prefill, {"p1"}) == {"p1"}  # saves landed: blocks may be freed

        # --- decode instance: the whole prompt but its last token's block comes from the pool.
        d1 = Request("d1", prompt)
        assert decode.sched.get_num_new_matched_tokens(d1, 0) == (96, False)
        assert decode.sched.get_num_new_matched_tokens(d1, 0) == (96, False)  # asked again
        decode.sched.update_state_after_alloc(d1, Blocks(blocks), 96)
        asked = rpc_count(server, "Lookup")
        meta, _, errors = decode.step(new_req(d1, blocks, 96, 4), {"d1": (prompt, blocks, 96, 100)})
        assert len(meta.meta.loads) == 1 and not meta.meta.saves and errors == set()
        assert rpc_count(server, "Lookup") - asked == 1  # one Lookup for every layer's read
        for layer in range(L):  # quant "none": the very bytes the prefill computed
            assert torch.equal(decode.tokens(layer, blocks, 100), layer_kv(prompt, layer))
        assert decode.sched.request_finished(d1, blocks) == (
            False,
            {"kvstore": {"prompt_tokens": 100, "saved_tokens": 96}},
        )

        # --- a second decode request with the engine's own prefix hit of 8 tokens (2 blocks),
        # and its blocks 2 and 3 of ours evicted between the match and the load.
        d2 = Request("d2", prompt)
        mine = list(range(25))
        decode.fill(mine)
        assert decode.sched.get_num_new_matched_tokens(d2, 8) == (88, False)
        decode.sched.update_state_after_alloc(d2, Blocks(mine), 88)
        kv = decode.sched.scheduler.kv  # type: ignore[union-attr]
        assert kv.release("d2") >= 1  # as if the hold had expired ...
        hashes = kv.block_hashes(prompt)
        evicted = asyncio.run(NodeClient(server.data, timeout_s=5).evict(kv.ns.id, hashes[2:4]))
        assert evicted.evicted >= 2 and evicted.kept == 0  # ... and the pool evicted two blocks
        meta, _, errors = decode.step(new_req(d2, mine, 8, 92), {})
        assert errors == set(range(8, 16))  # engine blocks of tokens 32..63: recompute them
        for layer in range(L):
            got, want = decode.tokens(layer, mine, 100), layer_kv(prompt, layer)
            assert bool((got[:, :8] == SENTINEL).all())  # the engine's own prefix: untouched
            assert torch.equal(got[:, 8:32], want[:, 8:32])
            assert torch.equal(got[:, 64:96], want[:, 64:96])
            assert bool((got[:, 32:64] == SENTINEL).all())  # not loaded: never zeros
        decode.sched.request_finished(d2, mine)

        # --- an aborted request on the prefill side: its saves are cancelled, reported done.
        other = [(11 * i + 1 + len(layout)) % 5000 for i in range(64)]
        p3 = Request("p3", other)
        prefill.sched.get_num_new_matched_tokens(p3, 0)
        prefill.sched.update_state_after_alloc(p3, Blocks(blocks[:16]), 0)
        prefill.step(new_req(p3, blocks[:16], 0, 64), {"p3": (other, blocks, 0, 64)})
        p3.status = SimpleNamespace(name="FINISHED_ABORTED")
        assert prefill.sched.request_finished(p3, blocks[:16]) == (True, None)
        meta, (sent, _), _ = prefill.step(SchedulerOutput(finished_req_ids={"p3"}), {})
        assert meta.meta.aborted == ("p3",)  # cancelled at bind: reported in this very step
        assert sent == {"p3"}
    finally:
        prefill.close()
        decode.close()
    # Holds released, no lease left by loads or saves. A ucx:// writer's unused grants
    # (the next layer's slots, granted ahead) pin their slots until they expire (2 s).
    deadline = time.monotonic() + 5
    while (pinned := asyncio.run(cluster.node_stats(server.data))["pinned_slots"]) != 0:
        assert time.monotonic() < deadline, f"{pinned} slots still pinned"
        time.sleep(0.1)


def test_engine_starts_with_the_pool_down_and_uses_it_once_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The connector never takes its engine down: built while nothing listens at the
    master's address, it warns once, matches nothing, saves nothing and reports the saves
    done (the engine frees the blocks); once a pool answers there, a later request uses it.
    The worker's client warms up as soon as it connects (asked for when the engine
    registered its caches), the scheduler's never does. The retry thread ends once
    connected, and closing leaves no thread behind."""
    import socket
    import threading

    from kvclient.lazy import PoolLink

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = f"127.0.0.1:{port}"
    threads_before = {t.name for t in threading.enumerate()}
    caplog.set_level("WARNING", logger="kvclient")
    caplog.set_level("INFO", logger="kvclient.lazy")
    cfg = vllm_config(master, "kv_both", f"down-{port}", "cpu_dn")
    cfg.kv_transfer_config.kv_connector_extra_config.update(retry_s=0.2, max_retry_s=0.4)
    sched = KVStoreConnector(cfg, SimpleNamespace(name="SCHEDULER"), None)
    work = KVStoreConnector(cfg, SimpleNamespace(name="WORKER"), None)
    caches = {n: pageforms.new("cpu_dn", NUM_BLOCKS, BS, H, D, torch.bfloat16) for n in LAYER_NAMES}
    work.register_kv_caches(caches)  # registering needs no pool
    prompt = [(5 * i + 1) % 5000 for i in range(40)]
    blocks = list(range(10))
    try:
        assert isinstance(sched._kv, PoolLink) and not sched._kv.connected
        warned = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warned) == 2  # one per connector (scheduler and worker), none per request
        r = Request("r1", prompt)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        sched.update_state_after_alloc(r, Blocks(blocks), 0)
        out = new_req(r, blocks, 0, 40)
        work.bind_connector_metadata(sched.build_connector_meta(out))
        work.start_load_kv(None)
        for name in LAYER_NAMES:
            work.wait_for_layer_load(name)
            work.save_kv_layer(name, caches[name], None)  # pool down: not stored, no raise
        work.wait_for_save()
        assert sched.request_finished(r, blocks)[0] is True  # saves were scheduled ...
        assert work.get_finished({"r1"}) == ({"r1"}, None)  # ... and end at once
        assert work.get_block_ids_with_load_errors() == set()
        work.clear_connector_metadata()
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 2

        srv = cluster.start_server("serve", "--grpc-port", str(port), "--data-port", "0",
                                   "--metrics-port", "0", "--host-mem", "64MiB")  # fmt: skip
        try:
            deadline = time.monotonic() + 20
            while not (sched._kv.connected and work._kv.connected):
                assert time.monotonic() < deadline, "never connected to the pool"
                time.sleep(0.1)
            retrying = [t for t in threading.enumerate() if t.name == "kvclient-connect"]
            for t in retrying:
                t.join(timeout=5)
            assert not any(t.is_alive() for t in retrying)  # the retry threads ended
            warmed = [r for r in caplog.records if "warm-up done" in r.getMessage()]
            assert len(warmed) == 1, caplog.text  # the worker's, on its connecting thread
            r2 = Request("r2", prompt)
            assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # pool empty
            sched.update_state_after_alloc(r2, Blocks(blocks), 0)
            work.bind_connector_metadata(sched.build_connector_meta(new_req(r2, blocks, 0, 40)))
            work.start_load_kv(None)
            for name in LAYER_NAMES:
                work.wait_for_layer_load(name)
                work.save_kv_layer(name, caches[name], None)
            work.wait_for_save()
            sched.request_finished(r2, blocks)
            finished: set[str] = set()
            for _ in range(100):
                finished |= work.get_finished({"r2"} - finished)[0] or set()
                if finished:
                    break
                time.sleep(0.05)
            assert finished == {"r2"}
            r3 = Request("r3", prompt)
            assert sched.get_num_new_matched_tokens(r3, 0) == (32, False)  # stored this time
            sched.request_finished(r3, blocks)
        finally:
            sched.shutdown()
            work.shutdown()
            rc, out = srv.stop()
            assert rc == 0, out
    finally:
        sched.shutdown()
        work.shutdown()
    left = {t.name for t in threading.enumerate()} - threads_before
    assert "kvclient-connect" not in left


def test_a_connected_pool_link_warms_up_on_a_thread_of_its_own(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """``PoolLink.warm_up`` returns at once and warms the client up on a thread
    (``kvclient-warm``): over ``ucx://`` the node is then ready for one-sided transfers.
    Once it ended, another call runs again. No thread is left."""
    import threading

    import kvclient
    from kvclient.lazy import PoolLink

    caplog.set_level("INFO", logger="kvclient.lazy")
    ns = kvclient.Namespace(model="warm", revision="r", num_layers=L, num_kv_heads=H,
                            head_dim=D, dtype=torch.bfloat16, block_tokens=B)  # fmt: skip
    link = PoolLink(server.grpc, ns, timeout_s=5)
    try:
        assert link.connected
        ucx = "ucx" in server.proc.args  # (serving's --transport)

        def warmed(n: int) -> list[str]:
            deadline = time.monotonic() + 20
            while len(done := [r.getMessage() for r in caplog.records
                               if "warm-up done" in r.getMessage()]) < n:  # fmt: skip
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
            while any(t.name == "kvclient-warm" for t in threading.enumerate()):
                assert time.monotonic() < deadline, "the warm-up thread did not end"
                time.sleep(0.05)
            return done

        link.warm_up()
        done = warmed(1)
        assert len(done) == 1 and done[0].endswith(f"ready to {int(ucx)} node(s)")
        link.warm_up()  # (the first ended: this one runs too)
        assert len(warmed(2)) == 2
    finally:
        link.close()
    assert "kvclient-warm" not in {t.name for t in threading.enumerate()}


def test_a_cache_in_kernel_blocks_smaller_than_the_schedulers_is_refused() -> None:
    """vLLM may split its blocks into a backend's smaller kernel blocks; the scheduler's
    block ids then do not index the cache, and the connector refuses rather than guess."""
    from kvclient.layouts import LayoutError

    cfg = vllm_config("127.0.0.1:1", "kv_both", "kernel-blocks", "bhnc_nhd")
    cfg.cache_config.block_size = 2 * BS
    work = KVStoreConnector(cfg, SimpleNamespace(name="WORKER"), None)
    try:
        caches = {n: pageforms.new("bhnc_nhd", 8, BS, H, D, torch.bfloat16) for n in LAYER_NAMES}
        with pytest.raises(LayoutError, match="kernel block"):
            work.register_kv_caches(caches)
    finally:
        work.shutdown()


def test_the_cpu_backends_amx_pages_register_and_certify() -> None:
    """vLLM's AMX pages (bfloat16 on CPUs with AMX) are tiles: the adapter maps them onto
    tiled K and V views, certifies them through the engine's write, and the worker holds
    a tiled cache (a whole registration, where the block size check must read the
    tensor's tokens per block, not the tiled view's first split)."""
    cfg = vllm_config("127.0.0.1:1", "kv_both", "amx-pages", "cpu_amx")
    cfg.cache_config.block_size = 32
    work = KVStoreConnector(cfg, SimpleNamespace(name="WORKER"), None)
    try:
        caches = {n: pageforms.new("cpu_amx", 8, 32, H, D, torch.bfloat16) for n in LAYER_NAMES}
        work.register_kv_caches(caches)
        held = work.worker._caches  # type: ignore[union-attr]
        assert len(held) == L and all(p.tiled and p.block_size == 32 for p in held)
    finally:
        work.shutdown()
