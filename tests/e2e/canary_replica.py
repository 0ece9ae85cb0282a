"""A replica for the canary tests: ``GET /`` answers ``v<VERSION>``; with ``FAIL_EVERY=N``,
every N-th request answers 500 instead (a revision that passes its probe, ``/healthz``,
and fails real users). Stdlib only, threaded, on ``$PORT``."""

from __future__ import annotations

import itertools
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = os.environ.get("VERSION", "?")
FAIL_EVERY = int(os.environ.get("FAIL_EVERY", "0"))
_count = itertools.count(1)
_lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Kept connections: the head and the body are two writes, and with Nagle's algorithm the
    # body waits for the head's ACK, which the peer delays (40 ms on Linux) as it has
    # nothing to send meanwhile.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        status = 200
        if self.path != "/healthz" and FAIL_EVERY:
            with _lock:
                n = next(_count)
            if n % FAIL_EVERY == 0:
                status = 500
        body = f"v{VERSION}".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header(
            "X-Preview-Token-Seen", str(bool(self.headers.get("X-Gateway-Preview-Token")))
        )
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler)
    server.daemon_threads = True
    server.serve_forever()
