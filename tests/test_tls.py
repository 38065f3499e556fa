"""TLS on the gRPC port, with real processes and certificates made here by ``openssl``: a
master serving TLS only, a node and clients (``KVClient``, ``kvctl``) that verify it
against a CA file, and the refusals — a plaintext client, a client trusting another CA,
and, where the master requires client certificates, a client without one. A private key
others can read, or a file that is not PEM, stops a server at start in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvclient
from tests.cluster import Server, start_server, start_servers
from tests.kvproc import layer_kv, namespace, prompt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

KVCTL = str(Path(sys.executable).with_name("kvctl"))


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, pem = d / f"{name}.key", d / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(key), "-out", str(pem), "-days", "2",
             "-subj", f"/CN=kvstore test {name}")  # fmt: skip
    return key, pem


def _signed(d: Path, name: str, ca: tuple[Path, Path], san: str) -> tuple[Path, Path]:
    key, csr, pem, ext = (d / f"{name}{s}" for s in (".key", ".csr", ".pem", ".ext"))
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")  # fmt: skip
    ext.write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]),
             "-CAcreateserial", "-out", str(pem), "-days", "2", "-extfile", str(ext))  # fmt: skip
    key.chmod(0o600)
    return pem, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tls")
    ca = _ca(d, "ca")
    other = _ca(d, "other-ca")
    server = _signed(d, "server", ca, "IP:127.0.0.1,DNS:localhost")
    client = _signed(d, "client", ca, "DNS:engine-1")
    return {"ca": ca[1], "other_ca": other[1], "server_cert": server[0],
            "server_key": server[1], "client_cert": client[0], "client_key": client[1]}  # fmt: skip


def _master(certs: dict[str, Path], *extra: str) -> Server:
    return start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                        "--tls-cert", str(certs["server_cert"]),
                        "--tls-key", str(certs["server_key"]), *extra)  # fmt: skip


def _node_args(master: Server, *extra: str) -> tuple[str, ...]:
    return ("node", "--master", master.grpc, "--data-port", "0", "--metrics-port", "0",
            "--host-mem", "64MiB", *extra)  # fmt: skip


def _kvctl(master: Server, *argv: str, env: dict[str, str] | None = None) -> Any:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run([KVCTL, "--master", master.grpc, *argv], capture_output=True,
                          text=True, timeout=60, env=clean | (env or {}), check=False)  # fmt: skip


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
    ok = _kvctl(master, "status", "--ca-file", str(certs["ca"]))
    assert ok.returncode == 0 and "1 (1 live)" in ok.stdout, ok.stdout + ok.stderr
    by_env = _kvctl(master, "nodes", "--json", env={"KVSTORE_TLS_CA": str(certs["ca"])})
    assert by_env.returncode == 0 and '"alive": true' in by_env.stdout, by_env.stderr
    plain = _kvctl(master, "--timeout", "3", "status")
    assert plain.returncode == 1, plain.stdout
    missing = _kvctl(master, "status", "--ca-file", "/nonexistent/ca.pem")
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
        assert _kvctl(master, "status", *both).returncode == 0
        assert _kvctl(master, "--timeout", "3", "status", *both[:2]).returncode == 1
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
    for cert, key, expected in (
        (certs["server_cert"], open_key, "chmod 600"),
        (not_pem, certs["server_key"], "not a PEM file"),
        (certs["server_cert"], None, "needs its key"),
    ):
        argv = ["--tls-cert", str(cert)] + (["--tls-key", str(key)] if key else [])
        run = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "master", "--grpc-port", "0",
             "--metrics-port", "0", *argv],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert run.returncode == 2 and expected in run.stderr, (expected, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
