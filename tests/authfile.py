"""The secrets the auth tests share, and the auth file that holds them."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ADMIN", "CLIENT", "CLIENT_B", "SECRET", "write_auth_file"]

SECRET = "cluster-secret-0123456789"
CLIENT = "client-token-team-a-0123456789"
CLIENT_B = "client-token-team-b-0123456789"
ADMIN = "admin-token-0123456789abcdef"


def write_auth_file(tmp: Path, mode: int = 0o600, extra: str = "") -> Path:
    """``tmp/auth.toml``: the cluster secret, client tokens of tenants ``team-a`` and
    ``team-b``, an admin token, then ``extra`` (more TOML), with file mode ``mode``."""
    path = tmp / "auth.toml"
    path.write_text(
        f'cluster_secret = "{SECRET}"\n'
        f'[[token]]\ntoken = "{CLIENT}"\nrole = "client"\ntenant = "team-a"\n'
        f'[[token]]\ntoken = "{CLIENT_B}"\nrole = "client"\ntenant = "team-b"\n'
        f'[[token]]\ntoken = "{ADMIN}"\nrole = "admin"\nname = "ops"\n' + extra
    )
    path.chmod(mode)
    return path
