"""A service's bearer tokens: where they come from, and the digests the data plane checks.

Three sources, merged into one ``{sha256 hex: id}`` per service (``digests``): the spec's
``auth.tokens_file`` (one a line, ``#`` comments), ``auth.tokens_env`` (the gateway's
environment, tokens separated by commas or white space), both read when the service's routing
is set (an apply, a change of tokens, a start); and the store's (added through the admin API,
kept by digest only: ``store.tokens``). A token's id names it without giving it away: the
store's are random (``tok_`` and 12 hex digits), a file's or the environment's are
``file:`` or ``env:`` and the first 12 hex digits of its digest.

A token made here (``new_token``) is 256 random bits, URL-safe: shown once, to whoever added
it, and nowhere after.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from .spec import AuthConfig

log = logging.getLogger(__name__)

MAX_TOKEN = 1024
"""Bytes; the data plane refuses a longer one unhashed (``gateway.proxy.guard``)."""
TOKEN_PATTERN = r"^[\x21-\x7e]{16,1024}$"
"""A token given to the API: printable ASCII, no space, 16 to 1024 characters."""
_TOKEN = re.compile(TOKEN_PATTERN)

Source = Literal["api", "file", "env"]


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """What may be shown of a token: never the token, nor its digest."""

    id: str
    source: Source
    label: str = ""
    created_at: float | None = None


def digest(token: str) -> str:
    """The SHA-256 (hex) the data plane looks a token up by."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(32)


def new_id() -> str:
    return f"tok_{secrets.token_hex(6)}"


def valid(token: str) -> bool:
    return bool(_TOKEN.fullmatch(token))


def configured(auth: AuthConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The digests of the tokens of ``auth.tokens_file`` and ``auth.tokens_env`` -> their ids.

    A file that cannot be read, or a variable that is not set, is logged (by name, never a
    token) and adds nothing: the service stays closed to everyone but the API's tokens."""
    out: dict[str, str] = {}
    if auth.tokens_file is not None:
        try:
            with open(auth.tokens_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            log.warning("auth.tokens_file %s cannot be read: %s", auth.tokens_file, e)
            lines = []
        _add(out, "file", (line.strip() for line in lines if not line.lstrip().startswith("#")))
    if auth.tokens_env is not None:
        value = (os.environ if environ is None else environ).get(auth.tokens_env)
        if value is None:
            log.warning("auth.tokens_env %s is not set", auth.tokens_env)
        else:
            _add(out, "env", re.split(r"[\s,]+", value))
    return out


def _add(out: dict[str, str], source: Source, tokens: Iterable[str]) -> None:
    for token in tokens:
        if not token:
            continue
        if len(token.encode()) > MAX_TOKEN:
            log.warning("a token of auth.tokens_%s is over %d bytes: ignored", source, MAX_TOKEN)
            continue
        d = digest(token)
        out.setdefault(d, f"{source}:{d[:12]}")


def infos(
    configured_ids: Iterable[str], stored: Iterable[tuple[str, str, float]]
) -> list[TokenInfo]:
    """The tokens of a service as the API lists them: the configured ones (by id), then the
    stored ones (id, label, created_at)."""
    out = [TokenInfo(i, "file" if i.startswith("file:") else "env") for i in configured_ids]
    out.extend(TokenInfo(i, "api", label, at) for i, label, at in stored)
    return out
