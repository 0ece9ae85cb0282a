"""A replica of a model server for the model-routing tests: OpenAI-compatible in shape only.

    PORT=9000 REPLICA_ID=llama-1 MODEL=llama python tests/e2e/model_replica.py

``POST`` any path: ``{"replica", "model", "path", "bytes", "version"}`` as JSON (``model``
as the body named it; ``version``: ``$VERSION``). ``GET /``: 200 (the probes). ``GET
/metrics``: vLLM's gauges (``vllm:num_requests_running`` the requests it holds now,
``vllm:num_requests_waiting`` and ``vllm:gpu_cache_usage_perc`` from ``$WAITING`` and
``$KV_CACHE``, or the waiting figure read from the file ``$WAITING_FILE`` at each scrape, for a
test to change). Standard library only: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
RUNNING = [0]


def waiting() -> str:
    path = os.environ.get("WAITING_FILE")
    if path:
        with open(path) as f:
            return f.read().strip()
    return os.environ.get("WAITING", "0")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # the head and the body are two writes (echo_replica.py)

    def answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            model = os.environ.get("MODEL", "")
            labels = f'{{model_name="{model}"}}'
            lines = [
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{labels} {RUNNING[0]}",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{labels} {waiting()}",
                "# TYPE vllm:gpu_cache_usage_perc gauge",
                f"vllm:gpu_cache_usage_perc{labels} {os.environ.get('KV_CACHE', '0')}",
            ]
            self.answer(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4")
            return
        self.answer(200, b'{"ok": true}')

    def do_POST(self) -> None:
        with LOCK:
            RUNNING[0] += 1
        try:
            data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                model = json.loads(data).get("model")
            except ValueError:
                model = None
            body = {
                "replica": os.environ.get("REPLICA_ID", ""),
                "model": model,
                "path": self.path,
                "bytes": len(data),
                "version": os.environ.get("VERSION", ""),
            }
            self.answer(200, json.dumps(body).encode())
        finally:
            with LOCK:
                RUNNING[0] -= 1

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler)
    server.daemon_threads = True
    server.serve_forever()
