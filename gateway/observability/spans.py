"""Spans of a sampled request: a server span for the gateway's hop, a client span for each
attempt upstream. PURE (but for the random span ids).

A ``Recording`` is made for a request whose trace is sampled when spans are exported
(``tracing.otlp_endpoint``); nothing is made for any other request. Its exchange tells it of
each attempt (``attempt``: the client span's id, sent upstream as the parent id of the
``traceparent``) and of an attempt's failure (``failed``), and at its end it gives the
finished spans (``finish``) as plain tuples (``Span``): a worker process sends them to the main
process as they are, and only the main process encodes them (``otlp``).

Invariants: a retried request has one client span per attempt, each the server span's child;
an attempt not told to have failed ends with the request, with its status and error; times
are the loop's clock, turned to the wall clock once, with ``wall`` (wall minus loop time).

Attribute names are OpenTelemetry's semantic conventions for HTTP where one exists
(``http.request.method``, ``http.response.status_code``, ``server.address``, ``url.path``,
``error.type``); the gateway's own are under ``gateway.``.
"""

from __future__ import annotations

import random
from typing import Final

from ..pool.events import RequestRecord
from ..pool.upstream import Upstream

SERVER: Final = 2
"""OTLP's ``SPAN_KIND_SERVER``."""
CLIENT: Final = 3
"""OTLP's ``SPAN_KIND_CLIENT``."""

Value = str | int | float | bool
Attributes = tuple[tuple[str, Value], ...]
Span = tuple[str, str, str, str, int, float, float, bool, Attributes]
"""A finished span: trace id, span id, parent span id ("" for a root), name, kind
(``SERVER``, ``CLIENT``), start and end (wall clock, seconds), whether it is an error, and its
attributes. Plain data, pickled as it is over a worker's channel."""


def span_id() -> str:
    """A new span id: 16 lower-case hex digits, not all zero."""
    value = random.getrandbits(64)
    while not value:
        value = random.getrandbits(64)
    return f"{value:016x}"


class Attempt:
    """One attempt upstream: its client span, open until ``end`` is set."""

    __slots__ = ("end", "error", "span_id", "start", "status", "upstream")

    def __init__(self, span: str, upstream: Upstream, start: float) -> None:
        self.span_id = span
        self.upstream = upstream
        self.start = start
        self.end = -1.0
        self.status = 0
        self.error: str | None = None


class Recording:
    """The spans of one sampled request while it runs."""

    __slots__ = ("attempts", "choice", "cold_start", "parent_id", "queued", "span_id", "trace_id")

    def __init__(self, trace_id: str, span: str, parent_id: str) -> None:
        self.trace_id = trace_id
        self.span_id = span
        """The server span's: the gateway's hop, as in the request id."""
        self.parent_id = parent_id
        """The caller's span ("" for a new trace)."""
        self.attempts: list[Attempt] = []
        self.queued = 0.0
        """Seconds the request waited for an upstream (held, or for a slot under a cap)."""
        self.cold_start = False
        """It was held while the service had no routable upstream (scaled to zero, starting)."""
        self.choice = ""
        """``preview``, ``canary`` or ``stable`` when the pick was a preview's or a split's."""

    def attempt(self, upstream: Upstream, now: float) -> str:
        """A new attempt on ``upstream`` begins (the one before it ended): its span id."""
        attempts = self.attempts
        if attempts and attempts[-1].end < 0:
            attempts[-1].end = now
        span = span_id()
        attempts.append(Attempt(span, upstream, now))
        return span

    def failed(self, kind: str, now: float, status: int = 0) -> None:
        """The current attempt failed with ``kind`` (a ``FailureKind``; ``status``: the
        answer's, if one came)."""
        attempts = self.attempts
        if attempts and attempts[-1].end < 0:
            attempt = attempts[-1]
            attempt.end = now
            attempt.error = kind
            attempt.status = status

    def finish(self, record: RequestRecord, host: str, now: float, wall: float) -> list[Span]:
        """The request ended at ``now`` (``record``: what it did): its spans, server first."""
        status = record.status
        error = record.error
        attributes: list[tuple[str, Value]] = [
            ("http.request.method", record.method),
            ("url.path", record.path),
            ("server.address", host),
            ("http.response.status_code", status),
            ("http.request.body.size", record.bytes_in),
            ("http.response.body.size", record.bytes_out),
            ("gateway.retries", record.retries),
        ]
        if record.service:
            attributes.append(("gateway.service", record.service))
        if record.revision is not None:
            attributes.append(("gateway.revision", record.revision))
        if record.upstream_id is not None:
            attributes.append(("gateway.upstream", record.upstream_id))
        if self.attempts:
            attributes.append(("network.peer.address", self.attempts[-1].upstream.address))
        if self.queued:
            attributes.append(("gateway.queue_wait", self.queued))
        if self.cold_start:
            attributes.append(("gateway.cold_start", True))
        if self.choice:
            attributes.append(("gateway.choice", self.choice))
        if error is not None:
            attributes.append(("error.type", error))
        name = record.method + " " + record.service if record.service else record.method
        server: Span = (
            self.trace_id,
            self.span_id,
            self.parent_id,
            name,
            SERVER,
            now - record.duration + wall,
            now + wall,
            error is not None or status >= 500,
            tuple(attributes),
        )
        spans = [server]
        last = len(self.attempts) - 1
        for index, attempt in enumerate(self.attempts):
            if attempt.end < 0:  # the last: it ended with the request
                attempt.end = now
                attempt.status = status if index == last else 0
                attempt.error = error
            spans.append(self._client(attempt, record.method, index, wall))
        return spans

    def _client(self, attempt: Attempt, method: str, index: int, wall: float) -> Span:
        upstream = attempt.upstream
        attributes: list[tuple[str, Value]] = [
            ("http.request.method", method),
            ("server.address", upstream.host),
            ("server.port", upstream.port),
            ("gateway.upstream", upstream.id),
            ("gateway.revision", upstream.revision),
            ("gateway.attempt", index + 1),
        ]
        if attempt.status:
            attributes.append(("http.response.status_code", attempt.status))
        error = attempt.error
        if error is not None:
            attributes.append(("error.type", error))
        return (
            self.trace_id,
            attempt.span_id,
            self.span_id,
            method,
            CLIENT,
            attempt.start + wall,
            attempt.end + wall,
            error is not None or attempt.status >= 500,
            tuple(attributes),
        )

    def __repr__(self) -> str:
        return f"<Recording {self.trace_id}-{self.span_id} attempts={len(self.attempts)}>"
