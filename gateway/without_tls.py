"""A process that makes no TLS connection leaves OpenSSL out: 4.9 MiB of a worker's memory.

A worker process (``gateway.workers.worker``) of a gateway with no HTTPS listener never makes
a TLS connection: upstreams are plain HTTP, and probes, ACME and the admin API run in the
main process. Yet two imports would load OpenSSL's libssl and libcrypto into it, whose
relocated pages are the process's own:

- ``ssl``, which uvloop imports when it loads (for its TLS transport), and asyncio after it;
- ``_hashlib``, which ``hashlib`` imports for OpenSSL's digests.

With ``GATEWAY_WITHOUT_TLS=1`` in its environment (the supervisor sets it for its workers
when no ``listen_tls`` is configured), the ``gateway`` package calls ``apply()`` before it
imports anything else:

- ``_hashlib`` and ``_ssl`` are refused (``None`` in ``sys.modules``): ``hashlib`` then gives
  CPython's own SHA-256 and BLAKE2b, as in an interpreter built without OpenSSL, with the
  same digests;
- ``ssl`` is a stand-in module with the names uvloop and asyncio read when they load. Its
  classes and functions that would make a TLS object refuse with ``TlsLeftOut``: a worker
  started without TLS cannot be asked for it by mistake and go on quietly.

A fresh interpreter that imports ``gateway.workers.worker`` is 26.3 MiB resident with
OpenSSL, 21.4 without (``tests/gateway/test_without_tls.py``, ``bench/memory.py``).
Not compiled: it runs before ``native.use``.
"""

from __future__ import annotations

import os
import sys
import types
from typing import NoReturn

ENV = "GATEWAY_WITHOUT_TLS"

REFUSED = ("_ssl", "_hashlib")
"""The extension modules that load OpenSSL."""


class TlsLeftOut(RuntimeError):
    """This process was started without OpenSSL (``GATEWAY_WITHOUT_TLS=1``)."""


_WHY = (
    "TLS is not available in this process: it was started without OpenSSL "
    f"({ENV}=1, a worker of a gateway with no listen_tls)"
)


def _refuse(*args: object, **kwargs: object) -> NoReturn:
    raise TlsLeftOut(_WHY)


class _Refused:
    """A TLS object's class: making one is refused."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        _refuse()


class SSLError(OSError):
    pass


class SSLZeroReturnError(SSLError):
    pass


class SSLWantReadError(SSLError):
    pass


class SSLWantWriteError(SSLError):
    pass


class SSLSyscallError(SSLError):
    pass


class SSLEOFError(SSLError):
    pass


class SSLCertVerificationError(SSLError, ValueError):
    pass


def standin() -> types.ModuleType:
    """The ``ssl`` module of a process without OpenSSL: what uvloop and asyncio read when
    they load (the error classes, the error numbers, the classes and the one function they
    keep a reference to), nothing that works."""
    module = types.ModuleType("ssl", f"A stand-in for ssl: {_WHY}.")
    names: dict[str, object] = {
        "SSLContext": type("SSLContext", (_Refused,), {}),
        "SSLObject": type("SSLObject", (_Refused,), {}),
        "SSLSocket": type("SSLSocket", (_Refused,), {}),
        "MemoryBIO": type("MemoryBIO", (_Refused,), {}),
        "create_default_context": _refuse,
        "SSLError": SSLError,
        "SSLZeroReturnError": SSLZeroReturnError,
        "SSLWantReadError": SSLWantReadError,
        "SSLWantWriteError": SSLWantWriteError,
        "SSLSyscallError": SSLSyscallError,
        "SSLEOFError": SSLEOFError,
        "SSLCertVerificationError": SSLCertVerificationError,
        "CertificateError": SSLCertVerificationError,
        "TlsLeftOut": TlsLeftOut,
        # OpenSSL's error numbers, as ssl.SSLErrorNumber has them.
        "SSL_ERROR_SSL": 1,
        "SSL_ERROR_WANT_READ": 2,
        "SSL_ERROR_WANT_WRITE": 3,
        "SSL_ERROR_WANT_X509_LOOKUP": 4,
        "SSL_ERROR_SYSCALL": 5,
        "SSL_ERROR_ZERO_RETURN": 6,
        "SSL_ERROR_WANT_CONNECT": 7,
        "SSL_ERROR_EOF": 8,
        "SSL_ERROR_INVALID_ERROR_CODE": 10,
    }
    for name, value in names.items():
        setattr(module, name, value)
    return module


def active() -> bool:
    """Whether this process runs without OpenSSL."""
    module = sys.modules.get("ssl")
    return module is not None and getattr(module, "TlsLeftOut", None) is TlsLeftOut


def apply(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Leave OpenSSL out of this process if its environment says so (``GATEWAY_WITHOUT_TLS=1``)
    and nothing loaded it yet. Returns whether it is left out."""
    env = os.environ if environ is None else environ
    if env.get(ENV) != "1":
        return False
    loaded = [name for name in ("ssl", *REFUSED) if sys.modules.get(name) is not None]
    if loaded and not active():
        raise RuntimeError(f"{ENV}=1 but OpenSSL is already loaded ({', '.join(loaded)})")
    for name in REFUSED:
        sys.modules[name] = None  # type: ignore[assignment]  # import refused: ImportError
    sys.modules["ssl"] = standin()
    return True
