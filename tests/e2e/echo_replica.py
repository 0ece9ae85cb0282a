"""A replica for the guard tests: says which replica answered and what headers it got.

    PORT=9000 REPLICA_ID=web-1 python tests/e2e/echo_replica.py

``GET /anything``: ``{"replica", "path", "headers", "most"}`` as JSON (header names
lower-cased; ``most``: the most ``/slow`` requests it has held at once so far);
``GET /slow?s=N``: the same after N seconds (requests are served each in a thread, so many
can be held at once). It listens on ``HOST`` (a cluster node's address), 127.0.0.1 without
one. Standard library only: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

LOCK = threading.Lock()
COUNTS = {"now": 0, "most": 0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Kept connections: the head and the body are two writes, and with Nagle's algorithm the
    # body waits for the head's ACK, which the peer delays (40 ms on Linux) as it has
    # nothing to send meanwhile.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/slow":  # the probes' "/" is not counted: they bypass the proxy
            with LOCK:
                COUNTS["now"] += 1
                COUNTS["most"] = max(COUNTS["most"], COUNTS["now"])
            try:
                time.sleep(float(parse_qs(url.query).get("s", ["0"])[0]))
            finally:
                with LOCK:
                    COUNTS["now"] -= 1
        body = json.dumps(
            {
                "replica": os.environ.get("REPLICA_ID", ""),
                "path": url.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "most": COUNTS["most"],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    address = (os.environ.get("HOST", "127.0.0.1"), int(os.environ["PORT"]))
    server = ThreadingHTTPServer(address, Handler)
    server.daemon_threads = True
    server.serve_forever()
