"""The reference engine (transformers' Llama and Qwen2, random weights, a paged cache driven
through kvclient.connector) against a real ``kvstore serve``: a prefill process and a decode
process give the greedy tokens of one process; a second prompt reuses a shared prefix from
the pool; a block that fails to load is recomputed; INT8's agreement is reported and
INT4's logits are checked."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the reference engine needs the 'engine' extra")

import kvclient
from examples.reference_engine import Engine, build_model, namespace, reference_generate
from kvstore.dataplane import NodeClient
from tests.cluster import Server, serving

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 8


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving("256MiB") as srv:
        yield srv


def prompts() -> tuple[list[int], list[int]]:
    """Two prompts sharing their first 48 tokens (3 blocks of 16), then apart."""
    rng = random.Random(7)
    shared = [rng.randrange(512) for _ in range(48)]
    return shared + [rng.randrange(512) for _ in range(22)], shared + [
        rng.randrange(512) for _ in range(9)
    ]


def engine_process(role: str, master: str, quant: str, batch: list[list[int]]) -> list[dict]:
    """Run one side of the deployment as its own OS process; its JSON lines."""
    cmd = [sys.executable, "-m", "examples.reference_engine", role, "--master", master,
           "--quant", quant, "--prompts", json.dumps(batch), "--max-new", str(MAX_NEW)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_prefill_and_decode_processes_give_the_tokens_of_one_process(server: Server) -> None:
    a, b = prompts()
    want = [reference_generate("llama", p, MAX_NEW).tokens for p in (a, b)]
    pre = engine_process("prefill", server.grpc, "none", [a, b])
    assert [p["tokens"][0] for p in pre] == [w[0] for w in want]
    assert [p["params"]["kvstore"]["first_token"] for p in pre] == [w[0] for w in want]
    assert pre[0]["loaded_tokens"] == 0  # a cold pool
    assert pre[1]["loaded_tokens"] == 48  # the shared prefix, saved by the first prompt
    dec = engine_process("decode", server.grpc, "none", [a, b])
    assert [d["tokens"] for d in dec] == want  # quant "none": exactly one process's tokens
    assert [d["loaded_tokens"] for d in dec] == [64, 48]  # whole blocks, the last token left
    assert all(d["recomputed_from"] is None for d in dec)


def test_int8_top1_agreement_and_largest_logit_difference(server: Server) -> None:
    a, b = prompts()
    ref = [reference_generate("llama", p, MAX_NEW) for p in (a, b)]
    engine_process("prefill", server.grpc, "int8", [a, b])
    dec = engine_process("decode", server.grpc, "int8", [a, b])
    agree = total = 0
    worst = 0.0
    for d, r in zip(dec, ref, strict=True):
        assert d["loaded_tokens"] > 0
        for got, want in zip(d["logits"], r.logits, strict=True):
            got_t = torch.tensor(got)
            worst = max(worst, float((got_t - want).abs().max()))
        agree += sum(x == y for x, y in zip(d["tokens"], r.tokens, strict=True))
        total += len(r.tokens)
    print(f"\nint8 through the pool: top-1 {agree}/{total}, largest |logit diff| {worst:.4f}")
    assert dec[0]["tokens"][0] == ref[0].tokens[0]  # the first token sees only loaded KV
    assert agree / total >= 0.75 and worst < 1.0


def test_a_block_that_fails_to_load_is_recomputed(server: Server) -> None:
    a, _ = prompts()
    want = reference_generate("llama", a, MAX_NEW).tokens
    ns = namespace("llama", "none")
    with kvclient.SyncKVClient.connect(server.grpc, ns) as kv:
        producer = Engine(build_model("llama"), kv, load=False, save=True)
        producer.generate(a, 1)  # the prompt's 4 whole blocks in the pool
        engine = Engine(build_model("llama"), kv, load=True, save=False, seed=5)
        req = engine.schedule(a, MAX_NEW)
        assert req.computed == 64
        # Between the match and the load the pool loses block 1 of ours (tokens 16..31).
        assert kv.release(req.rid) >= 1
        evicted = asyncio.run(
            NodeClient(server.data, timeout_s=5).evict(ns.id, kv.block_hashes(a)[1:2])
        )
        assert evicted.evicted >= 1
        out = engine.run(req)
        assert out.load_errors == {req.blocks[i] for i in range(4, 8)}  # its engine blocks
        assert out.recomputed_from == 16
        assert out.tokens == want


def test_qwen2_in_process_prefill_then_decode(server: Server) -> None:
    a, _ = prompts()
    want = reference_generate("qwen2", a, MAX_NEW).tokens
    with kvclient.SyncKVClient.connect(server.grpc, namespace("qwen2", "none")) as kv:
        Engine(build_model("qwen2"), kv, load=True, save=True).generate(a, 1)
        out = Engine(build_model("qwen2"), kv, load=True, save=False, seed=9).generate(a, MAX_NEW)
    assert out.loaded_tokens == 64 and out.tokens == want


def test_int4_through_the_paged_cache_moves_logits_more_than_int8_and_little(
    server: Server,
) -> None:
    """An INT4 namespace end to end through the engine's paged cache: the decode loads the
    prompt's blocks, and its logits stay near one process's — farther than INT8's (so the
    KV really went through INT4), within a tenth of the logits' spread on average (bench/
    codec.py reports the agreement over more prompts)."""
    a, b = prompts()
    ref = [reference_generate("llama", p, MAX_NEW) for p in (a, b)]
    moved = {}
    for quant in ("int8", "int4"):
        with kvclient.SyncKVClient.connect(server.grpc, namespace("llama", quant)) as kv:
            for p in (a, b):
                Engine(build_model("llama"), kv, load=False, save=True).generate(p, 1)
            outs = [Engine(build_model("llama"), kv, load=True, save=False).generate(p, MAX_NEW)
                    for p in (a, b)]  # fmt: skip
        assert [o.loaded_tokens for o in outs] == [64, 48]
        moved[quant] = max(float(((g - w).abs() / w.std()).mean())
                           for o, r in zip(outs, ref, strict=True)
                           for g, w in zip(o.logits, r.logits, strict=True))  # fmt: skip
    print(f"\nmean |logit diff| / logit std, worst step: {moved}")
    assert moved["int8"] < moved["int4"] < 0.1


def test_decode_streams_layers_while_the_prefill_process_computes(server: Server) -> None:
    """The layer-pipelined deployment: the decode process is started first and told the
    prompt is being prefilled; it loads each layer as the prefill process saves it."""
    rng = random.Random(11)
    prompt = [rng.randrange(512) for _ in range(90)]
    want = reference_generate("llama", prompt, MAX_NEW).tokens
    cmd = [sys.executable, "-m", "examples.reference_engine", "decode", "--stream",
           "--master", server.grpc, "--quant", "none", "--prompts", json.dumps([prompt]),
           "--max-new", str(MAX_NEW)]  # fmt: skip
    decode = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert decode.stderr is not None
        line = ""
        for _ in range(200):  # bounded: until the decode side awaits the layers
            line = decode.stderr.readline()
            if not line or "reference_engine: streaming" in line:
                break
        assert "streaming" in line, "the decode process did not start streaming"
        engine_process("prefill", server.grpc, "none", [prompt])
        out, err = decode.communicate(timeout=300)
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.communicate(timeout=10)
    assert decode.returncode == 0, err[-4000:]
    got = json.loads(out.splitlines()[0])
    assert got["tokens"] == want and got["loaded_tokens"] == 80
    assert got["recomputed_from"] is None


def test_a_stream_whose_prefill_never_comes_is_recomputed(server: Server) -> None:
    rng = random.Random(12)
    prompt = [rng.randrange(512) for _ in range(40)]
    want = reference_generate("llama", prompt, MAX_NEW).tokens
    with kvclient.SyncKVClient.connect(server.grpc, namespace("llama", "none")) as kv:
        engine = Engine(build_model("llama"), kv, load=True, save=False, stream_s=1.0)
        params = {"kvstore": {"stream": True, "prompt_tokens": len(prompt)}}
        out = engine.generate(prompt, MAX_NEW, params)
    assert out.recomputed_from == 0 and out.tokens == want
