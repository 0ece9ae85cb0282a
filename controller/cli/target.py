"""Where the admin API is: ``--admin`` / ``--token``, else ``GATEWAY_ADMIN_URL`` /
``GATEWAY_ADMIN_TOKEN``, else the gateway config named by ``-c``, else ``DEFAULT_URL``."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway import parse_address

from ..config import ConfigError, load_config
from .exits import EXIT_UNUSABLE, CliError

DEFAULT_URL = "http://127.0.0.1:8081"
URL_ENV = "GATEWAY_ADMIN_URL"
TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"
REQUEST_TIMEOUT = 30.0


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None


def admin_url(listen: str) -> str:
    """The URL at which a client reaches an admin listener bound to ``listen``."""
    host, port = parse_address(listen, listen=True)
    if port == 0:
        raise CliError(f"admin.listen {listen!r} has no fixed port: pass --admin", EXIT_UNUSABLE)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def resolve_target(args: argparse.Namespace, env: dict[str, str] | None = None) -> Target:
    """Flags first, then the environment, then the gateway config, then the default."""
    environ = os.environ if env is None else env
    url = args.admin or environ.get(URL_ENV) or None
    token = args.token or environ.get(TOKEN_ENV) or None
    if args.config and (url is None or token is None):
        try:
            config = load_config(args.config).config
            token = token or config.admin_token()
        except ConfigError as e:
            raise CliError(str(e).replace("\n", " "), EXIT_UNUSABLE) from None
        url = url or admin_url(config.admin.listen)
    url = (url or DEFAULT_URL).rstrip("/")
    try:
        parsed = urlsplit(url)
        host = parsed.hostname
    except ValueError:  # a bracketed host that is not an IPv6 address, a bad port
        host = None
    if parsed.scheme not in ("http", "https") or not host:
        raise CliError(f"not an admin API URL: {url!r} (e.g. {DEFAULT_URL})", EXIT_UNUSABLE)
    return Target(url, token)
