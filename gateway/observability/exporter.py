"""The span exporter: the main process's task that sends finished spans to an OTLP/HTTP
collector, a batch at a time, off the request path.

Spans wait in a ``SpanBuffer`` (the data plane's in this process, or the workers' handed over
their channel); when a batch is due, it is encoded (``otlp``) and POSTed to
``tracing.otlp_endpoint`` with aiohttp's client, one export at a time. An export that fails
(the collector down, an answer other than 2xx) or that takes longer than ``tracing.timeout``
drops its batch and counts it (``SpanBuffer.dropped``): there is no retry, since the buffer
keeps filling meanwhile and is bounded. Only the main process imports this module.

Invariants: at most one export in flight; ``stop`` lets the export in flight end, then
sends what is left (until an export fails); every span is exported or counted as dropped;
nothing here is awaited by a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from . import otlp
from .span_buffer import SpanBuffer
from .spans import Span

if TYPE_CHECKING:
    import aiohttp

    from ..config import TracingConfig

log = logging.getLogger(__name__)


class SpanExporter:
    """Exports ``buffer``'s spans as ``config`` says (``start``, then ``stop``)."""

    def __init__(self, config: TracingConfig, buffer: SpanBuffer | None = None) -> None:
        assert config.otlp_endpoint is not None
        self.endpoint = config.otlp_endpoint
        self.config = config
        self.buffer = buffer if buffer is not None else SpanBuffer()
        self.buffer.wake = self._wake
        self.exported = 0
        """Spans the collector accepted."""
        self.failures = 0
        """Exports that failed (their spans are in ``buffer.dropped``)."""
        self._woken = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._failing = False
        self._stopping = False

    def _wake(self) -> None:
        self._woken.set()

    def start(self) -> None:
        """Begin exporting, on the running loop."""
        import aiohttp

        self._session = aiohttp.ClientSession(
            headers={**self.config.headers, "Content-Type": otlp.CONTENT_TYPE},
            timeout=aiohttp.ClientTimeout(total=self.config.timeout),
        )
        self._task = asyncio.create_task(self._run(), name="span-exporter")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the span exporter stopped", exc_info=task.exception())

    async def stop(self) -> None:
        """Export what is left (once, within the timeout), then stop."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            self._woken.set()
            await task  # an export in flight ends (its timeout bounds it)
        loop = asyncio.get_running_loop()
        buffer = self.buffer
        while len(buffer) and self._session is not None:
            if not await self.export(buffer.take(loop.time())):
                break
        buffer.discard()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        buffer = self.buffer
        while not self._stopping:
            now = loop.time()
            if buffer.due(now):
                await self.export(buffer.take(now))
                continue
            self._woken.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(buffer.until_due(now)):
                    await self._woken.wait()

    async def export(self, batch: list[Span]) -> bool:
        """Send one batch; on failure its spans are counted as dropped. True if accepted."""
        session = self._session
        if not batch or session is None:
            return False
        body = otlp.encode(batch, self.config.service_name)
        import aiohttp

        try:
            async with session.post(self.endpoint, data=body) as response:
                await response.read()
                ok = 200 <= response.status < 300
                reason = f"status {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            ok, reason = False, repr(e)
        except asyncio.CancelledError:
            self.buffer.lost(len(batch))  # stopped mid-export (``stop``): counted all the same
            raise
        if ok:
            self.exported += len(batch)
            if self._failing:
                log.info("spans are exported to %s again", self.endpoint)
            self._failing = False
            return True
        self.failures += 1
        self.buffer.lost(len(batch))
        if not self._failing:  # once per outage, not once per batch
            log.warning("spans dropped: the export to %s failed (%s)", self.endpoint, reason)
        self._failing = True
        return False

    def __repr__(self) -> str:
        return (
            f"<SpanExporter {self.endpoint} exported={self.exported} failures={self.failures}"
            f" {self.buffer!r}>"
        )
