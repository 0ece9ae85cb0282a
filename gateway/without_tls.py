"""OpenSSL loaded only by a process that makes or takes TLS connections.

OpenSSL's libssl and libcrypto are 4.8 MiB of a gateway process's resident memory (their
relocated pages are the process's own), and two imports load them:

- ``_hashlib``, which ``hashlib`` imports for OpenSSL's digests;
- ``ssl``, which uvloop imports when it loads (for its TLS transport), and asyncio after it.

**Digests** (``builtin_digests``, called first thing by the ``gateway`` package): ``_hashlib``
is refused unless something loaded it already, and ``hashlib`` gives CPython's own SHA-256,
BLAKE2b and the rest, as in an interpreter built without OpenSSL: the same digests, as fast on
the short inputs a gateway hashes (SHA-256 of 40 bytes: 281 ns against OpenSSL's 325). A
process that loads ``ssl`` maps libcrypto all the same.

**TLS** (``leave_out_ssl``): ``_ssl`` is refused and ``ssl`` is a stand-in with the names
uvloop, asyncio and other libraries read when they load. Its classes and functions that would
make a TLS object refuse with ``TlsLeftOut``: a process started without TLS cannot be asked
for it and go on quietly. Who leaves TLS out:

- a worker process (``gateway.workers.worker``) of a gateway with no HTTPS listener: the
  supervisor sets ``GATEWAY_WITHOUT_TLS=1`` in its environment, and ``apply`` acts on it
  before the package imports anything else (upstreams are plain HTTP; probes, ACME and the
  admin API run in the main process);
- the main process of ``gateway serve``, once its config says nothing needs TLS there
  (``controller.config.tls_needed``), before it imports the event loop.

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
    """This process was started without OpenSSL (``leave_out_ssl``)."""


_WHY = (
    "TLS is not available in this process: it was started without OpenSSL, its gateway's "
    "config having no listen_tls, ACME, Docker engine or etcd cluster (gateway.without_tls)"
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

    def missing(name: str) -> object:
        # Any other public name (a constant or class a library reads when it loads, as
        # an HTTP library does for its defaults): a class that refuses to be
        # made, so that the import works and any use says why it cannot.
        if name.startswith("_"):
            raise AttributeError(f"module 'ssl' has no attribute {name!r}")
        value = type(name, (_Refused,), {})
        setattr(module, name, value)
        return value

    module.__getattr__ = missing  # type: ignore[method-assign]  # PEP 562
    return module


def active() -> bool:
    """Whether this process runs without TLS (``ssl`` is the stand-in)."""
    module = sys.modules.get("ssl")
    return module is not None and getattr(module, "TlsLeftOut", None) is TlsLeftOut


def builtin_digests() -> bool:
    """Refuse ``_hashlib`` if nothing loaded it yet: ``hashlib`` then gives CPython's own
    digests. Returns whether it is refused."""
    if "_hashlib" in sys.modules:
        return sys.modules["_hashlib"] is None
    sys.modules["_hashlib"] = None  # type: ignore[assignment]  # import refused: ImportError
    return True


def leave_out_ssl(*, strict: bool = True) -> bool:
    """Refuse ``_ssl`` and put the stand-in ``ssl`` in place. If ``ssl`` or OpenSSL's digests
    are loaded already, it is too late: an error if ``strict``, else nothing is changed.
    Returns whether TLS is left out."""
    if active():
        return True
    loaded = [name for name in ("ssl", *REFUSED) if sys.modules.get(name) is not None]
    if loaded:
        if not strict:
            return False
        raise RuntimeError(
            f"OpenSSL is already loaded ({', '.join(loaded)}): too late to leave out"
        )
    for name in REFUSED:
        sys.modules[name] = None  # type: ignore[assignment]  # import refused: ImportError
    sys.modules["ssl"] = standin()
    return True


def apply(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """CPython's own digests (``builtin_digests``); and with ``GATEWAY_WITHOUT_TLS=1`` in the
    environment, no TLS (``leave_out_ssl``). Returns whether TLS is left out."""
    builtin_digests()
    env = os.environ if environ is None else environ
    if env.get(ENV) != "1":
        return False
    leave_out_ssl()
    return True
