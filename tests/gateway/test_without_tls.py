"""A process started with GATEWAY_WITHOUT_TLS=1 loads no OpenSSL, and says so when asked for TLS.

The process cases run a fresh interpreter (the test process has ssl loaded): it imports what
a worker imports, serves one request on uvloop over a real loopback socket, and reports what
it mapped, its digests and what asking for TLS gave.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import without_tls

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = r"""
import gateway.workers.worker  # first, as ``python -m gateway.workers.worker`` does
import asyncio, hashlib, json, sys
import uvloop
import ssl

async def one_request():
    async def answer(reader, writer):
        await reader.readline()
        writer.write(b"pong\n")
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"ping\n")
    line = await reader.readline()
    writer.close()
    server.close()
    return line.decode().strip()

refusals = []
for make in (ssl.SSLContext, ssl.create_default_context, ssl.MemoryBIO):
    try:
        make()
        refusals.append("made")
    except Exception as exc:
        refusals.append(type(exc).__name__)
with open("/proc/self/maps") as maps:
    mapped = maps.read()
print(json.dumps({
    "answer": uvloop.run(one_request()),
    "libcrypto": "libcrypto" in mapped,
    "libssl": "libssl" in mapped,
    "loaded": sorted(m for m in ("_ssl", "_hashlib") if sys.modules.get(m) is not None),
    "sha256": hashlib.sha256(b"abc").hexdigest(),
    "blake2b": hashlib.blake2b(b"abc", digest_size=8).hexdigest(),
    "refusals": refusals,
}))
"""


def run(env_value: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != without_tls.ENV}
    if env_value is not None:
        env[without_tls.ENV] = env_value
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_worker_started_without_tls_maps_no_openssl_and_serves():
    seen = run("1")
    assert seen["answer"] == "pong"
    assert (seen["libcrypto"], seen["libssl"], seen["loaded"]) == (False, False, [])
    # CPython's own digests: the same values (FIPS 180-2's "abc"; RFC 7693's BLAKE2b).
    assert seen["sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert seen["blake2b"] == "d8bb14d833d59559"
    assert seen["refusals"] == ["TlsLeftOut"] * 3


def test_without_the_setting_tls_works_and_digests_are_cpythons_own():
    seen = run(None)
    # ssl maps libcrypto as always; hashlib uses CPython's digests (the gateway package
    # refused _hashlib before anything imported hashlib), with the same values.
    assert (seen["libcrypto"], seen["loaded"]) == (True, ["_ssl"])
    assert seen["sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert seen["refusals"] == ["made"] * 3
    assert run("0")["libcrypto"] is True


def test_too_late_to_leave_openssl_out_changes_nothing():
    import ssl  # noqa: F401  (loaded in this process: too late to leave it out)

    before = {name: sys.modules.get(name) for name in ("ssl", "_ssl", "_hashlib")}
    with pytest.raises(RuntimeError, match="already loaded"):
        without_tls.apply({without_tls.ENV: "1"})
    assert without_tls.leave_out_ssl(strict=False) is False  # what gateway serve asks
    assert without_tls.builtin_digests() is False  # _hashlib was loaded first here
    assert {name: sys.modules.get(name) for name in before} == before
    assert not without_tls.active()
    assert without_tls.apply({}) is False


def test_the_standin_has_what_uvloop_reads_when_it_loads():
    uvloop_names = (
        "SSLContext MemoryBIO create_default_context SSLError SSLWantReadError "
        "SSLSyscallError SSLZeroReturnError CertificateError SSL_ERROR_WANT_READ "
        "SSL_ERROR_WANT_WRITE SSL_ERROR_SYSCALL"
    ).split()
    module = without_tls.standin()
    assert all(hasattr(module, name) for name in uvloop_names)
    import ssl

    for name in uvloop_names:
        if name.startswith("SSL_ERROR"):
            assert getattr(module, name) == getattr(ssl, name), name
    assert issubclass(module.SSLWantReadError, OSError)
    assert issubclass(module.CertificateError, ValueError)
    # What else a library reads when it loads (a default it names, for one) is
    # there, and refuses to be used.
    with pytest.raises(without_tls.TlsLeftOut, match="started without OpenSSL"):
        module.PROTOCOL_TLS_SERVER()
    with pytest.raises(AttributeError):
        module._private_name  # noqa: B018
