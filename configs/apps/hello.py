"""The demo replica: a tiny HTTP server (standard library only) that says who answered.

Listens on $HOST:$PORT (the gateway's backend sets both) and answers every ``GET`` with
JSON: ``/healthz`` (what the gateway probes) with ``{"status": "ok"}``, any other path with
``{"message": "hello from <REPLICA_ID>", "version": "$VERSION", "path": "<path>"}``.
``STARTUP_DELAY`` seconds of warm-up before it listens show health-gated admission: the
gateway sends it nothing until the probe passes.
"""

import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = os.environ.get("VERSION", "v1")
REPLICA = os.environ.get("REPLICA_ID", "?")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Kept connections: the head and the body are two writes, and with Nagle's algorithm the
    # body waits for the head's ACK, which the peer delays (40 ms on Linux) as it has
    # nothing to send meanwhile.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        if self.path == "/healthz":
            body = b'{"status": "ok"}\n'
        else:
            doc = {"message": f"hello from {REPLICA}", "version": VERSION, "path": self.path}
            body = (json.dumps(doc) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    time.sleep(float(os.environ.get("STARTUP_DELAY", "0")))
    server = ThreadingHTTPServer(
        (os.environ.get("HOST", "127.0.0.1"), int(os.environ["PORT"])), Handler
    )
    print(f"{REPLICA} version {VERSION} listening on {server.server_address}", flush=True)
    server.serve_forever()
