"""A gRPC replica for the end-to-end tests: a grpcio server on 127.0.0.1:$PORT (or argv[1])
with a generic handler (bytes in, bytes out: no .proto to compile) and the standard health
service. Methods of ``test.Echo``:

- ``Unary``: the request back, prefixed with the replica's ``NAME`` (``v1:`` by default);
  a request ``not-found`` ends with NOT_FOUND and a message; ``sleep:S`` waits S seconds;
- ``Split`` (server-streaming): one answer per byte of the request;
- ``Join`` (client-streaming): the requests joined;
- ``Chat`` (bidi): each request back as it comes, upper-cased;
- ``Tick`` (server-streaming): a request ``N S`` gets N answers ``NAME:REPLICA_ID:i``, S
  seconds apart (a stream held open, ``bench/zero_downtime.py``).

``PIDDIR``, if set: a directory where ``<REPLICA_ID>.pid`` is written at start (as
``bench/replica_app.py`` does), so the harness can find a replica left running.

``TLS_CERT`` and ``TLS_KEY``, if set: PEM files; the replica serves over TLS
(``grpc.ssl_server_credentials``) instead of h2c; with ``TLS_CLIENT_CA`` too, it requires a
client certificate signed by that CA (mutual TLS).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

NAME = os.environ.get("NAME", "v1").encode()
REPLICA = os.environ.get("REPLICA_ID", f"pid{os.getpid()}").encode()


def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    if request == b"not-found":
        context.abort(grpc.StatusCode.NOT_FOUND, "no such thing: not-found")
    if request.startswith(b"sleep:"):
        time.sleep(float(request[6:]))
    return NAME + b":" + request


def split(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for i in range(len(request)):
        yield request[i : i + 1]


def join(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return b"".join(requests)


def chat(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    for request in requests:
        yield request.upper()


def tick(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    count, interval = request.split()
    for i in range(int(count)):
        if i:
            time.sleep(float(interval))
        yield b"%s:%s:%d" % (NAME, REPLICA, i)


def main() -> None:
    port = sys.argv[1] if len(sys.argv) > 1 else os.environ["PORT"]
    piddir = os.environ.get("PIDDIR")
    if piddir:
        Path(piddir, f"{REPLICA.decode()}.pid").write_text(str(os.getpid()))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    same = {"request_deserializer": None, "response_serializer": None}
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Echo",
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(unary, **same),
                    "Split": grpc.unary_stream_rpc_method_handler(split, **same),
                    "Join": grpc.stream_unary_rpc_method_handler(join, **same),
                    "Chat": grpc.stream_stream_rpc_method_handler(chat, **same),
                    "Tick": grpc.unary_stream_rpc_method_handler(tick, **same),
                },
            ),
        )
    )
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    checker.set("test.Echo", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    cert, key = os.environ.get("TLS_CERT"), os.environ.get("TLS_KEY")
    if cert and key:
        client_ca = os.environ.get("TLS_CLIENT_CA")
        credentials = grpc.ssl_server_credentials(
            [(Path(key).read_bytes(), Path(cert).read_bytes())],
            root_certificates=Path(client_ca).read_bytes() if client_ca else None,
            require_client_auth=bool(client_ca),
        )
        server.add_secure_port(f"127.0.0.1:{port}", credentials)
    else:
        server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()


if __name__ == "__main__":
    main()
