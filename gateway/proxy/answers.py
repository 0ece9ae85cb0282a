"""What the gateway answers itself around HTTPS: ACME's HTTP-01 challenges, redirects to
HTTPS, the Strict-Transport-Security header. PURE but for the challenge file's read.

The ACME client (``controller.acme``) writes each challenge's key authorization to
``<challenges>/<token>``; the PLAIN listeners answer ``GET /.well-known/acme-challenge/<token>``
from that file for any Host, before any route (RFC 8555 section 8.3: the CA fetches it over
HTTP on port 80). A token is base64url (``[A-Za-z0-9_-]``): anything else is 404, so no path
can reach outside the directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

from ..config import Hsts
from ..errors import NoRoute, OwnAnswer

CHALLENGE_PREFIX: Final = b"/.well-known/acme-challenge/"
_TOKEN: Final = re.compile(rb"[A-Za-z0-9_-]{1,256}")


def challenge_answer(challenges: Path, target: bytes) -> OwnAnswer | NoRoute:
    """The answer to a request for ``target`` (under ``CHALLENGE_PREFIX``)."""
    token = target[len(CHALLENGE_PREFIX) :].partition(b"?")[0]
    if _TOKEN.fullmatch(token):
        try:
            body = (challenges / token.decode("ascii")).read_bytes()
        except OSError:
            pass
        else:
            return OwnAnswer(
                200,
                "ACME challenge",
                {"Content-Type": "application/octet-stream", "Cache-Control": "no-store"},
                body,
            )
    path = target.decode("latin-1")
    return NoRoute(f"no ACME challenge at {path!r}", path=path)


def https_redirect(host: bytes, target: bytes, https_port: int) -> OwnAnswer:
    """308 to the same URL over HTTPS (the method and body are kept, RFC 9110 15.4.9)."""
    name = host.decode("latin-1")
    if name.startswith("["):  # [v6]:port
        name = name[: name.find("]") + 1]
    else:
        name = name.partition(":")[0]
    authority = name if https_port == 443 else f"{name}:{https_port}"
    location = f"https://{authority}{target.decode('latin-1')}"
    return OwnAnswer(308, "redirect to HTTPS", {"Location": location})


def hsts_field(hsts: Hsts) -> bytes:
    """The ``Strict-Transport-Security`` header line (RFC 6797 section 6.1)."""
    value = f"max-age={int(hsts.max_age)}"
    if hsts.include_subdomains:
        value += "; includeSubDomains"
    if hsts.preload:
        value += "; preload"
    return b"Strict-Transport-Security: " + value.encode()
