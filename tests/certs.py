"""Certificates for the TLS tests, made by the ``openssl`` command: EC P-256 CAs and
certificates they sign, valid for two days."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["make_ca", "make_signed"]

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA in ``d``: (its key, its certificate)."""
    key, pem = d / f"{name}.key", d / f"{name}.pem"
    _openssl("req", "-x509", *_EC, "-keyout", str(key), "-out", str(pem), "-days", "2",
             "-subj", f"/CN=kvstore test {name}")  # fmt: skip
    return key, pem


def make_signed(
    d: Path, name: str, ca: tuple[Path, Path], san: str, days: int = 2
) -> tuple[Path, Path]:
    """A certificate ``ca`` signed for ``san`` (``IP:127.0.0.1``) valid from now for
    ``days`` (negative: expired that long ago): (certificate, key), the key chmod 600."""
    key, csr, pem, ext = (d / f"{name}{s}" for s in (".key", ".csr", ".pem", ".ext"))
    _openssl("req", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext.write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]),
             "-CAcreateserial", "-out", str(pem), "-days", str(days),
             "-extfile", str(ext))  # fmt: skip
    key.chmod(0o600)
    return pem, key
