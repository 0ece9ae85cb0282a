"""``OtlpReceiver``: a real OTLP/HTTP trace receiver on loopback for the tests, decoding each
``ExportTraceServiceRequest`` with opentelemetry-proto, as a collector would.

It can answer an error status (``status``) or hold every export unanswered (``hold``: a slow
collector); ``spans`` are the spans received, ``changed`` awaits the next export.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support.raw_servers import cleanup_runner


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value"))


@dataclass(frozen=True)
class ReceivedSpan:
    """A span as the receiver decoded it (ids in hex, attributes as a dict)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start: int
    end: int
    error: bool
    attributes: dict[str, Any]
    service_name: str


class OtlpReceiver:
    """``POST /v1/traces`` on 127.0.0.1 (``endpoint``, once ``start``ed)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests: list[dict[str, str]] = []
        """Each export's header fields."""
        self.status = 200
        self.hold = False
        self._changed = asyncio.Event()
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await cleanup_runner(self._runner)

    async def changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    def by_trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    async def _export(self, request: web.Request) -> web.Response:
        self.requests.append(dict(request.headers))
        if self.hold:
            await self._release.wait()
        body = ExportTraceServiceRequest.FromString(await request.read())
        if self.status == 200:
            for resource_spans in body.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            ReceivedSpan(
                                span.trace_id.hex(),
                                span.span_id.hex(),
                                span.parent_span_id.hex(),
                                span.name,
                                span.kind,
                                span.start_time_unix_nano,
                                span.end_time_unix_nano,
                                span.status.code == span.status.STATUS_CODE_ERROR,
                                {a.key: _value(a.value) for a in span.attributes},
                                resource["service.name"],
                            )
                        )
        self._changed.set()
        return web.Response(
            status=self.status,
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )
