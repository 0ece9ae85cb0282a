"""Preview routes: a request that asks for one revision of its service, by header
(``X-Gateway-Revision: 3``) or by host label (``r3--hello.example.com``), so that a revision
can be tried before it takes any traffic. PURE.

A service's ``preview.allow`` says who may: ``off`` (the header is not read, a labelled host
routes nowhere: 404), ``anyone``, or ``token``: a request bearing, in ``preview.token_header``,
a token whose SHA-256 is one of ``preview.tokens`` (the admin token's and the service's, set
by the controller); any other is refused with 403, and the token never goes upstream. A
revision with no routable upstream is a 503, never another revision's answer.
"""

from __future__ import annotations

import json
import re
from typing import Final

from ..config import PreviewConfig
from ..errors import BadRequest, OwnAnswer
from ..wire.headers import Fields

_LABEL: Final = re.compile(rb"([a-z]{0,8})([0-9]{1,9})--(.+)")


def labelled(host: bytes) -> tuple[bytes, int, bytes] | None:
    """``(prefix, revision, host)`` of a host like ``r3--hello.example.com``, or None."""
    found = _LABEL.fullmatch(host.lower())
    if found is None:
        return None
    return found[1], int(found[2]), found[3]


def forbidden(message: str) -> OwnAnswer:
    body = json.dumps({"error": "forbidden", "message": message}).encode()
    return OwnAnswer(403, message, {"Content-Type": "application/json"}, body)


def field(headers: Fields, name: bytes) -> bytes | None:
    """The value of the header ``name`` (lower-cased), or None."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def asked(
    preview: PreviewConfig, headers: Fields, host_label: bytes | None, host_revision: int | None
) -> int | None:
    """The revision a request asks for, if it asks for one and may; raises the 400 or 403.

    ``host_label``/``host_revision``: what a labelled host named (``labelled``), if it did.
    """
    if preview.allow == "off":
        return None
    revision = None
    if host_revision is not None:
        if not preview.host_prefix or host_label != preview.host_prefix.encode():
            return None
        revision = host_revision
    else:
        value = field(headers, preview.header.lower().encode())
        if value is None:
            return None
        text = value.strip()
        if not text.isdigit() or len(text) > 9:
            raise BadRequest(f"{preview.header}: not a revision number")
        revision = int(text)
    if preview.allow == "token":
        token = field(headers, preview.token_header.lower().encode())
        if token is None:
            raise forbidden(f"a preview route needs a token in {preview.token_header}")
        import hashlib  # here: a worker that sees no preview token imports no digests
        import hmac

        digest = hashlib.sha256(token.strip()).hexdigest()
        if not any(hmac.compare_digest(digest, known) for known in preview.tokens):
            raise forbidden("the preview token is not valid for this service")
    return revision
