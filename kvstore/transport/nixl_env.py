"""Where UCX listens: the network interface that owns a host address, and the UCX
environment set (under a lock, only while an agent is created) from it (see
:mod:`kvstore.transport.nixl`)."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import threading

from kvstore.errors import InvalidArgument

__all__ = ["ENV_LOCK", "UCX_ENV", "net_device_for", "set_ucx_env"]

_SIOCGIFADDR = 0x8915
ENV_LOCK = threading.Lock()
UCX_ENV = ("UCX_NET_DEVICES", "UCX_WARN_UNUSED_ENV_VARS")
_UNSET = object()
_operator_net_devices: object = _UNSET  # UCX_NET_DEVICES before this module first set it


def net_device_for(host: str | None) -> str | None:
    """The network interface UCX should use to serve ``host``, or None for all of them.

    Loopback addresses give the loopback interface (``lo``); ``None``, ``""``, ``0.0.0.0``
    and ``::`` give None; a name is resolved first. The owner is the interface whose
    primary IPv4 address (``SIOCGIFADDR``) or any IPv6 address (``/proc/net/if_inet6``)
    equals it; Linux only. Blocks on name resolution. Raises
    :class:`~kvstore.errors.InvalidArgument` if it does not resolve or no interface owns it.
    """
    if host is None or host in ("", "*"):
        return None
    try:
        family_addr = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
        addr = ipaddress.ip_address(str(family_addr).split("%")[0])
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot resolve host {host!r}: {exc}") from exc
    if addr.is_unspecified:
        return None
    if addr.is_loopback:
        addr = ipaddress.ip_address("127.0.0.1" if addr.version == 4 else "::1")
    owner = _ipv4_owner(addr) if addr.version == 4 else _ipv6_owner(addr)
    if owner is None:
        raise InvalidArgument(f"no local network interface has address {addr} (host {host!r})")
    return owner


def _ipv4_owner(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == str(addr):
                return name
    return None


def _ipv6_owner(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == addr:
                    return fields[5]
    except OSError:
        return None
    return None


def set_ucx_env(net_devices: str | None) -> None:
    """Point UCX at ``net_devices`` (None: what the operator had) before creating an agent."""
    global _operator_net_devices
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if _operator_net_devices is _UNSET:
        _operator_net_devices = os.environ.get("UCX_NET_DEVICES")
    wanted = net_devices if net_devices is not None else _operator_net_devices
    if isinstance(wanted, str):
        os.environ["UCX_NET_DEVICES"] = wanted
    else:
        os.environ.pop("UCX_NET_DEVICES", None)
