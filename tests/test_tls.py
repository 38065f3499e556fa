"""TLS on the gRPC port, with real processes and certificates made here by ``openssl``: a
master serving TLS only, a node and clients (``KVClient``, ``kvctl``) that verify it
against a CA file, and the refusals — a plaintext client, a client trusting another CA,
and, where the master requires client certificates, a client without one. A private key
others can read, or a file that is not PEM, stops a server at start in one line."""

from __future__ import annotations

import asyncio
import selectors
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvclient
from kvstore.transport import connect
from kvstore.transport.tls import check_certificate
from tests.certs import make_ca, make_signed
from tests.cluster import Server, run_kvctl, start_server, start_servers
from tests.kvproc import layer_kv, namespace, prompt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tls")
    ca = make_ca(d, "ca")
    other = make_ca(d, "other-ca")
    server = make_signed(d, "server", ca, "IP:127.0.0.1,DNS:localhost")
    client = make_signed(d, "client", ca, "DNS:engine-1")
    named = make_signed(d, "named", ca, "DNS:localhost")  # (not 127.0.0.1)
    expired = make_signed(d, "expired", ca, "IP:127.0.0.1", days=-1)
    return {"ca": ca[1], "other_ca": other[1], "server_cert": server[0],
            "server_key": server[1], "client_cert": client[0], "client_key": client[1],
            "named_cert": named[0], "named_key": named[1],
            "expired_cert": expired[0], "expired_key": expired[1]}  # fmt: skip


def _master(certs: dict[str, Path], *extra: str) -> Server:
    return start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                        "--tls-cert", str(certs["server_cert"]),
                        "--tls-key", str(certs["server_key"]), *extra)  # fmt: skip


def _node_args(master: Server, *extra: str) -> tuple[str, ...]:
    return ("node", "--master", master.grpc, "--data-port", "0", "--metrics-port", "0",
            "--host-mem", "64MiB", *extra)  # fmt: skip


async def _round_trip(master: Server, seed: int, **tls: str) -> None:
    tokens = prompt(512, seed=seed)
    async with await kvclient.KVClient.connect(master.grpc, namespace(1), **tls) as kv:
        assert await kv.put_layer(tokens, 0, layer_kv(512, 0, seed)) == 512
        assert await kv.match_prefix(tokens) == 512
        assert (await kv.get_layer(tokens, 0)).shape[1] == 512


@pytest.fixture
def tls_pool(certs: dict[str, Path]) -> Iterator[Server]:
    master = _master(certs)
    [node] = start_servers(_node_args(master, "--tls-ca", str(certs["ca"])))
    try:
        yield master
    finally:
        node.stop()
        master.stop()


async def test_a_tls_master_serves_verified_clients_and_refuses_the_rest(
    tls_pool: Server, certs: dict[str, Path]
) -> None:
    master = tls_pool
    assert "tls=on" in master.lines[-1]
    await _round_trip(master, 81, ca_file=str(certs["ca"]))  # the node registered over TLS
    for bad in ({}, {"ca_file": str(certs["other_ca"])}):  # plaintext; another CA
        with pytest.raises(kvclient.errors.Unreachable):
            await kvclient.KVClient.connect(master.grpc, namespace(1), timeout_s=3, **bad)
    ok = run_kvctl(master, "status", "--ca-file", str(certs["ca"]))
    assert ok.returncode == 0 and "1 (1 live)" in ok.stdout, ok.stdout + ok.stderr
    by_env = run_kvctl(master, "nodes", "--json", env={"KVSTORE_TLS_CA": str(certs["ca"])})
    assert by_env.returncode == 0 and '"alive": true' in by_env.stdout, by_env.stderr
    plain = run_kvctl(master, "--timeout", "3", "status")
    assert plain.returncode == 1, plain.stdout
    # One line on stderr each (gRPC's own log lines kept off it), saying why.
    assert plain.stderr.count("\n") == 1 and "give --ca-file" in plain.stderr, plain.stderr
    other = run_kvctl(master, "--timeout", "3", "status", "--ca-file", str(certs["other_ca"]))
    assert other.returncode == 1 and other.stderr.count("\n") == 1, other.stderr
    assert "did not verify against the CA given: unable to get local issuer" in other.stderr
    elsewhere = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                             "--tls-cert", str(certs["named_cert"]),
                             "--tls-key", str(certs["named_key"]))  # fmt: skip
    try:  # a certificate that names localhost, not 127.0.0.1
        named = run_kvctl(elsewhere, "--timeout", "3", "status", "--ca-file", str(certs["ca"]))
    finally:
        elsewhere.stop()
    assert "does not name the address given" in named.stderr, named.stderr
    missing = run_kvctl(master, "status", "--ca-file", "/nonexistent/ca.pem")
    assert missing.returncode == 2 and "/nonexistent/ca.pem" in missing.stderr


async def test_mutual_tls_requires_a_client_certificate(certs: dict[str, Path]) -> None:
    master = _master(certs, "--tls-client-ca", str(certs["ca"]))
    mine = ("--tls-cert", str(certs["client_cert"]), "--tls-key", str(certs["client_key"]))
    [node] = start_servers(_node_args(master, "--tls-ca", str(certs["ca"]), *mine))
    try:
        with pytest.raises(kvclient.errors.Unreachable):  # verified the master, no cert
            await kvclient.KVClient.connect(
                master.grpc, namespace(1), timeout_s=3, ca_file=str(certs["ca"])
            )
        await _round_trip(master, 82, ca_file=str(certs["ca"]),
                          cert_file=str(certs["client_cert"]),
                          key_file=str(certs["client_key"]))  # fmt: skip
        both = ["--ca-file", str(certs["ca"]), "--cert-file", str(certs["client_cert"]),
                "--key-file", str(certs["client_key"])]  # fmt: skip
        assert run_kvctl(master, "status", *both).returncode == 0
        no_cert = run_kvctl(master, "--timeout", "3", "status", *both[:2])
        assert no_cert.returncode == 1 and "give --cert-file, --key-file" in no_cert.stderr
    finally:
        node.stop()
        master.stop()


def test_a_readable_key_or_a_file_that_is_not_pem_stops_the_server(
    certs: dict[str, Path], tmp_path: Path
) -> None:
    open_key = tmp_path / "open.key"
    open_key.write_bytes(certs["server_key"].read_bytes())
    open_key.chmod(0o644)
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello\n")
    cases: list[tuple[Path | None, Path | None, str]] = [
        (certs["server_cert"], open_key, "chmod 600"),
        (not_pem, certs["server_key"], "not a PEM file"),
        (certs["server_cert"], None, "needs its key"),
        (None, None, "--tls-client-ca needs --tls-cert"),  # (it started in plaintext)
        (certs["expired_cert"], certs["expired_key"], "certificate has expired"),
    ]
    for cert, key, expected in cases:
        argv = ["--tls-cert", str(cert)] if cert else ["--tls-client-ca", str(certs["ca"])]
        argv += ["--tls-key", str(key)] if key else []
        run = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "master", "--grpc-port", "0",
             "--metrics-port", "0", *argv],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert run.returncode == 2 and expected in run.stderr, (expected, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_a_certificate_not_naming_the_servers_address_is_said_at_start(
    certs: dict[str, Path],
) -> None:
    """A master whose certificate does not name the address its ports are on starts (a
    client may dial a name the certificate has), with one line on stderr saying so; one
    that names it, or a wildcard address, says nothing."""
    assert check_certificate(str(certs["server_cert"]), str(certs["server_key"]), "127.0.0.1") == ""
    assert check_certificate(str(certs["named_cert"]), str(certs["named_key"]), "0.0.0.0") == ""
    assert check_certificate(str(certs["named_cert"]), str(certs["named_key"]), "localhost") == ""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "master", "--grpc-port", "0", "--metrics-port",
         "0", "--tls-cert", str(certs["named_cert"]), "--tls-key", str(certs["named_key"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = proc.stdout.readline() if sel.select(timeout=60) else ""
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "kvstore ready" in ready, err
    warning = err.splitlines()[0]
    assert warning.startswith("kvstore master: warning: TLS certificate "), err
    assert "does not name 127.0.0.1" in warning, warning


async def test_a_tls_data_port_serves_verified_clients_and_drains_over_tls(
    certs: dict[str, Path],
) -> None:
    """Nodes with ``--data-tls``: their data URIs are ``tls://``; a client with the CA file
    puts and reads through them, kvctl drains one onto the other (the copies go node to
    node over TLS, verified with the node's ``--tls-ca``), every byte reads back; a
    plaintext connection to the port gets no frame."""
    master = _master(certs)
    tls = ("--tls-ca", str(certs["ca"]), "--tls-cert", str(certs["server_cert"]),
           "--tls-key", str(certs["server_key"]), "--data-tls")  # fmt: skip
    nodes = start_servers(_node_args(master, *tls), _node_args(master, *tls))
    try:
        assert all(n.data.startswith("tls://127.0.0.1:") for n in nodes)
        tokens = prompt(1024, seed=83)
        ca = str(certs["ca"])
        async with await kvclient.KVClient.connect(master.grpc, namespace(1), ca_file=ca) as kv:
            assert await kv.put_layer(tokens, 0, layer_kv(1024, 0, 83)) == 1024
            ref = (await kv.get_layer(tokens, 0)).clone()
            victim = nodes[0].addresses["node"]
            run = run_kvctl(master, "drain", victim, "--wait", "--wait-s", "60", "--json",
                         "--ca-file", ca)  # fmt: skip
            assert run.returncode == 0, run.stdout + run.stderr
            nodes.pop(0).stop()
            deadline = asyncio.get_running_loop().time() + 15
            while await kv.match_prefix(tokens) < 1024:  # (the drained node's lease ends)
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.2)
            assert torch.equal(await kv.get_layer(tokens, 0), ref)
        plain = await connect(nodes[0].data.replace("tls://", "tcp://"), timeout=5)
        await plain.send({"op": "stats"}, timeout=5)
        with pytest.raises(kvclient.errors.TransportError):
            await plain.recv_header(timeout=5)
        await plain.close()
    finally:
        for node in nodes:
            node.stop()
        master.stop()
