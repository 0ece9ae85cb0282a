"""An OTLP/HTTP trace receiver that accepts every export and keeps nothing, for the benches.

    python bench/otlp_sink.py PORT

``POST /v1/traces``: the body is read whole and answered 200 with an empty
``ExportTraceServiceResponse`` (no bytes). Standard library only, one thread a connection; on
SIGTERM it prints how many exports and bytes it took.
"""

from __future__ import annotations

import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TAKEN = {"exports": 0, "bytes": 0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        TAKEN["exports"] += 1
        TAKEN["bytes"] += length
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)

    def stop(*_: object) -> None:
        print(f"otlp sink: {TAKEN['exports']} exports, {TAKEN['bytes']} bytes", flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()


if __name__ == "__main__":
    main()
