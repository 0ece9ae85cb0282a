"""Why an HTTP request had no answer, in a user's words (``connection refused``, ``no answer in
time``), for every place the controller reports one: the command line, the Docker Engine
client, a follower's forward to its leader. aiohttp's own text names its connector's TLS
setting, ``ssl:default``, for plain HTTP and unix sockets too, and asyncio's says ``Connect call
failed`` whatever the cause.
"""

from __future__ import annotations

import os

import aiohttp


def unreachable_reason(error: BaseException) -> str:
    """Why a request had no answer: ``connection refused``."""
    if isinstance(error, aiohttp.ClientConnectorCertificateError):
        return f"its certificate is not trusted: {error.certificate_error}"
    if isinstance(error, aiohttp.ClientConnectorDNSError):
        return f"no such host: {error.host}"
    if isinstance(error, aiohttp.ClientSSLError):
        return f"TLS failed: {error.os_error}"
    if isinstance(error, aiohttp.ClientConnectorError):
        return _os_reason(error.os_error)
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "it closed the connection without an answer"
    if isinstance(error, TimeoutError):
        return "no answer in time"
    if isinstance(error, OSError) and not isinstance(error, aiohttp.ClientError):
        return _os_reason(error)
    return str(error) or type(error).__name__


def _os_reason(error: OSError) -> str:
    """``connection refused``: the system's words for its errno (asyncio's text is
    ``Connect call failed ('127.0.0.1', 8081)`` whatever the cause)."""
    if not error.errno or error.errno < 0:
        return str(error) or type(error).__name__
    text = os.strerror(error.errno)
    return text[:1].lower() + text[1:]
