"""The TLS settings of every server context: TLS 1.2 and 1.3, OpenSSL's defaults otherwise.

``ssl.create_default_context(Purpose.CLIENT_AUTH)`` is OpenSSL's secure default (its cipher
list, no SSLv3/TLS 1.0/1.1 with the system's policy); on top: TLS 1.2 at least, no
renegotiation (a client-initiated renegotiation is refused: CVE-2011-1473's CPU lever), no
compression (CRIME), the server's cipher order, ALPN as ``tls.alpn`` says (``h2`` before
``http/1.1`` by default). Session tickets are on unless asked off; their key is the
context's own, made by OpenSSL when the context is made, so replacing the contexts
(``CertificateStore.rotate``) replaces the key.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence


def server_context(*, tickets: bool, alpn: Sequence[str]) -> ssl.SSLContext:
    """A server context with the gateway's TLS settings and no certificate yet."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION
    context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    context.set_alpn_protocols(list(alpn))
    if not tickets:
        context.options |= ssl.OP_NO_TICKET
        context.num_tickets = 0
    return context
