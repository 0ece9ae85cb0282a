"""The config of the state store and of this node in a cluster (``state`` and ``node``).

``state.store: sqlite`` (the default) keeps the state in ``<state_dir>/gateway.db`` on one node.
``state.store: etcd`` keeps it in etcd under ``state.etcd.prefix``, shared by every node that
names the same endpoints and prefix: each node serves traffic, one leads (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway import Duration, parse_address

from ..schema import Model

NODE_NAME_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$"
HOST_PATTERN = r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?"


class EtcdTls(Model):
    """TLS to etcd: the CA that signed its certificates, and a client pair if it asks for one."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> EtcdTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class EtcdConfig(Model):
    endpoints: tuple[str, ...] = Field(min_length=1)
    """Client URLs of the etcd members, e.g. ``http://10.0.0.1:2379``."""
    prefix: str = "/gateway/"
    """Every key of this cluster lies under it: two clusters can share one etcd."""
    tls: EtcdTls | None = None
    username: str | None = None
    password_env: str | None = None
    """The environment variable that holds the password of ``username``."""
    timeout: Duration = Field(default=2.0, gt=0)
    """How long one etcd call may take, every member tried, before it counts as unreachable."""

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            parts = urlsplit(url)
            if (
                parts.scheme not in ("http", "https")
                or not parts.hostname
                or parts.path
                not in (
                    "",
                    "/",
                )
            ):
                raise ValueError(f"{url!r}: an endpoint is http(s)://host:port")
        return tuple(u.rstrip("/") for u in value)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/") or "\x00" in value:
            raise ValueError("must start with '/'")
        return value if value.endswith("/") else value + "/"

    @model_validator(mode="after")
    def _credentials(self) -> EtcdConfig:
        if (self.username is None) != (self.password_env is None):
            raise ValueError("username and password_env go together")
        return self

    def password(self) -> str | None:
        return None if self.password_env is None else os.environ.get(self.password_env, "")


class StateConfig(Model):
    store: Literal["sqlite", "etcd"] = "sqlite"
    etcd: EtcdConfig | None = None

    @model_validator(mode="after")
    def _etcd(self) -> StateConfig:
        if self.store == "etcd" and self.etcd is None:
            raise ValueError("store etcd needs state.etcd (endpoints at least)")
        if self.store == "sqlite" and self.etcd is not None:
            raise ValueError("state.etcd is only read with store: etcd")
        return self


class NodeConfig(Model):
    """This gateway process as a node of a cluster (read with ``state.store: etcd`` only)."""

    name: str = Field(
        default_factory=lambda: socket.gethostname().lower(), pattern=NODE_NAME_PATTERN
    )
    """Unique in the cluster; the host name by default."""
    address: str | None = None
    """This node's host address (an IP or a name the other nodes resolve): its replicas listen
    there, and the other nodes reach its admin API there, on ``admin.listen``'s port. By
    default ``admin.listen``'s host, unless that is a wildcard (then 127.0.0.1)."""
    lease_ttl: int = Field(default=5, ge=2, le=60)
    """Seconds: a node that stops renewing its lease is gone from the cluster after this long,
    and a leader that cannot renew stops acting before it ends."""
    forget_after: Duration = Field(default=600.0, gt=0)
    """A node gone this long (its lease ended, and it did not register again) is forgotten:
    the leader deletes the running records its replicas left. Until then, a node that comes
    back adopts its replicas from them and stops those no longer placed."""

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_address(value))
        if not re.fullmatch(HOST_PATTERN, value):
            raise ValueError(f"{value!r}: a host address (an IP or a host name), without port")
        return value

    def host(self, admin_listen: str) -> str:
        """``address``, or the admin listener's host unless it is a wildcard."""
        if self.address is not None:
            return self.address
        host, _ = parse_address(admin_listen, listen=True)
        return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host

    def admin_unreachable(self, admin_listen: str) -> str | None:
        """Why the other nodes, which forward admin requests to the leader at ``address`` on
        ``admin_listen``'s port, would not reach this node's admin API there; None if they
        can, as far as the two addresses tell (a host name is not resolved here)."""
        if self.address is None:
            return None
        host, port = parse_address(admin_listen, listen=True)
        if host in ("", "0.0.0.0", "::") or host == self.address:
            return None
        listen_ip, node_ip = _ip(host), _ip(self.address)
        if listen_ip is not None and node_ip is not None:
            differs = listen_ip != node_ip
        else:
            differs = _loopback(host) and not _loopback(self.address)
        if not differs:
            return None
        there = f"[{self.address}]" if ":" in self.address else self.address
        return (
            f"admin.listen {admin_listen} takes connections on {host} only, but the other "
            f"nodes reach this node's admin API at node.address {self.address}, port {port}: "
            f"listen on {there}:{port} (or 0.0.0.0:{port}), or set node.address to {host}"
        )


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _loopback(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" if ip is None else ip.is_loopback
