"""Micro-benchmark: the TLS record layer's cost in-process, through memory BIOs, no sockets.

    .venv/bin/python bench/tls_bio.py [--repeat 7]

Drives ``gateway.tls.transport.TlsConnection`` with a fake TCP transport against a client
``ssl.SSLObject`` in the same process: full handshakes (TLS 1.3, trustme's ECDSA
certificate), resumed ones (a session ticket) and a small request and answer on an open
connection (one record each way). Both ends run here, so each figure is the client's and the
server's CPU together; the client is the same in every variant. Variants, interleaved
repetition by repetition: ``public`` (``SSLContext.wrap_bio``, an ``ssl.SSLObject``, as the
gateway does) and ``private`` (the C object from CPython's ``SSLContext._wrap_bio``, as it
did before 9c5759a). On the compiled modules if built (``gateway native status``). CPU
time (``time.process_time``): the machine's other load counts less.
"""

from __future__ import annotations

import argparse
import ssl
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trustme

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway import native

native.use()  # the compiled modules if built, as the gateway runs them
from gateway.proxy.http1_downstream import ConnectionGate  # noqa: E402
from gateway.tls.context import server_context  # noqa: E402
from gateway.tls.handshake import HandshakeTally  # noqa: E402
from gateway.tls.transport import TlsConnection  # noqa: E402

REQUEST = b"GET / HTTP/1.1\r\nHost: example.test\r\n\r\n"
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Tcp:
    """The TCP transport: keeps what is written."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(bytes(data))

    def take(self) -> bytes:
        data = b"".join(self.out)
        self.out.clear()
        return data

    def close(self) -> None: ...
    def abort(self) -> None: ...
    def write_eof(self) -> None: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class App:
    """The client connection: answers each request it is given."""

    secure = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(ANSWER)

    def eof_received(self) -> None: ...
    def connection_lost(self, exc: BaseException | None) -> None: ...


class Loop:
    def call_later(self, *args: Any) -> None: ...
    def call_soon(self, *args: Any) -> None: ...


def public(conn: Any) -> Any:
    """What ``TlsConnection`` makes: an ``ssl.SSLObject``."""
    return SERVER.wrap_bio(conn._incoming, conn._outgoing, server_side=True)


def private(conn: Any) -> Any:
    """What it made before 9c5759a: the C object, from the private ``_wrap_bio``."""
    return SERVER._wrap_bio(conn._incoming, conn._outgoing, True, None)  # type: ignore[attr-defined]


class Pair:
    """A server ``TlsConnection`` on OpenSSL's object made by ``make``, and a client,
    handshaken. (``make``'s object replaces the one ``connection_made`` made, unused, in
    both variants alike: a compiled ``TlsConnection`` cannot be subclassed.)"""

    def __init__(self, make: Callable[[Any], Any], session: ssl.SSLSession | None = None) -> None:
        self.conn = TlsConnection(App(), SERVER, 0, GATE, TALLY, Loop())  # type: ignore[arg-type]
        self.tcp = Tcp()
        self.conn.connection_made(self.tcp)  # type: ignore[arg-type]
        self.conn._ssl = make(self.conn)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.client = CLIENT.wrap_bio(
            self.incoming, self.outgoing, server_hostname="example.test", session=session
        )
        for _ in range(20):
            try:
                self.client.do_handshake()
                return
            except ssl.SSLWantReadError:
                pass
            self.conn.data_received(self.outgoing.read())
            self.incoming.write(self.tcp.take())
        raise RuntimeError("no handshake")

    def request(self) -> bytes:
        self.client.write(REQUEST)
        self.conn.data_received(self.outgoing.read())
        self.incoming.write(self.tcp.take())
        return self.client.read(4096)


CA = trustme.CA()
SERVER = server_context(tickets=True, alpn=("http/1.1",))
CA.issue_cert("example.test").configure_cert(SERVER)
CLIENT = ssl.create_default_context()
CA.configure_trust(CLIENT)
GATE, TALLY = ConnectionGate(10**9), HandshakeTally()
VARIANTS: dict[str, Callable[[Any], Any]] = {"private": private, "public": public}


def step(what: str, kind: Callable[[Any], Any], n: int) -> float:
    """CPU microseconds per handshake or per request and answer."""
    pair = Pair(kind)
    pair.request()  # the session tickets come with the first answer's records
    session = pair.client.session
    start = time.process_time()
    if what == "records":
        for _ in range(n):
            pair.request()
    else:
        for _ in range(n):
            again = Pair(kind, session if what == "resumed" else None)
            assert again.client.session_reused == (what == "resumed")
    return (time.process_time() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(f"data plane: {native.running.split(':')[0]}")
    for what, n in (("full", 200), ("resumed", 500), ("records", 20000)):
        got: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.repeat):
            for name, kind in VARIANTS.items():
                got[name].append(step(what, kind, n))
        for name, us in got.items():
            print(f"{what:8} {name:8} median {statistics.median(us):8.2f} us CPU, "
                  f"min {min(us):8.2f} (n={n} x {args.repeat}, interleaved)")  # fmt: skip


if __name__ == "__main__":
    main()
