"""A replica of a model server for the model-routing tests: OpenAI-compatible in shape only.

    PORT=9000 REPLICA_ID=llama-1 MODEL=llama python tests/e2e/model_replica.py

``POST`` any path: ``{"replica", "model", "path", "bytes", "version", "usage"}`` as JSON
(``model`` as the body named it; ``version``: ``$VERSION``; ``usage.completion_tokens``: the
body's ``max_tokens``, 3 if none). With ``"stream": true`` in the body: server-sent events,
chunked, as OpenAI streams a chat completion: a role-only chunk, then ``max_tokens`` chunks of
content (``tok0 ``, ``tok1 ``...), the first ``$FIRST_TOKEN_DELAY`` seconds after the request
(0.05) and each next ``$TOKEN_DELAY`` after the one before (0.01), a chunk with ``usage`` if
``stream_options.include_usage``, and ``data: [DONE]``. ``GET /``: 200 (the probes). ``GET
/metrics``: vLLM's gauges (``vllm:num_requests_running`` the requests it holds now,
``vllm:num_requests_waiting`` and ``vllm:gpu_cache_usage_perc`` from ``$WAITING`` and
``$KV_CACHE``, or the waiting figure read at each scrape from the file ``$WAITING_FILE``, or
from ``$WAITING_DIR/$REPLICA_ID`` if there is one, for a test to change). Standard library
only: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
RUNNING = [0]


def waiting() -> str:
    path = os.environ.get("WAITING_FILE")
    directory = os.environ.get("WAITING_DIR")
    if directory:
        path = os.path.join(directory, os.environ.get("REPLICA_ID", ""))
        if not os.path.exists(path):
            return "0"
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
                asked = json.loads(data)
            except ValueError:
                asked = None
            if not isinstance(asked, dict):
                asked = {}
            tokens = int(asked.get("max_tokens", 3))
            if asked.get("stream"):
                self.stream(asked.get("model"), tokens, bool(asked.get("stream_options")))
                return
            body = {
                "replica": os.environ.get("REPLICA_ID", ""),
                "model": asked.get("model"),
                "path": self.path,
                "bytes": len(data),
                "version": os.environ.get("VERSION", ""),
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens},
            }
            self.answer(200, json.dumps(body).encode())
        finally:
            with LOCK:
                RUNNING[0] -= 1

    def stream(self, model: object, tokens: int, usage: bool) -> None:
        """The answer as server-sent events, one chunk each, at the delays of the env."""
        started = time.monotonic()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        first = float(os.environ.get("FIRST_TOKEN_DELAY", "0.05"))
        gap = float(os.environ.get("TOKEN_DELAY", "0.01"))
        replica = os.environ.get("REPLICA_ID", "")

        def event(delta: dict[str, str] | None, **extra: object) -> None:
            chunk: dict[str, object] = {"object": "chat.completion.chunk", "model": model}
            chunk["choices"] = [] if delta is None else [{"index": 0, "delta": delta}]
            chunk.update(extra)
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        event({"role": "assistant"}, replica=replica)
        for i in range(tokens):
            time.sleep(max(0.0, started + first + i * gap - time.monotonic()))
            event({"content": f"tok{i} "})
        if usage:
            event(None, usage={"prompt_tokens": 1, "completion_tokens": tokens})
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler)
    server.daemon_threads = True
    server.serve_forever()
