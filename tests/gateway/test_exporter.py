"""The span exporter (``gateway.observability.exporter``) against a real OTLP/HTTP receiver
on loopback: batches arrive decoded with their resource and the configured header fields; a
receiver that is down, refuses, or is slow costs only the spans of its batches, counted."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.config import TracingConfig, parse_settings
from gateway.observability.exporter import SpanExporter
from gateway.observability.span_buffer import SpanBuffer
from gateway.observability.spans import SERVER, Span
from tests.support.eventually import eventually
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.ports import free_port

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def spans(count: int, first: int = 1) -> list[Span]:
    return [
        (TRACE, f"{i:016x}", "", "GET", SERVER, 1.0, 2.0, False, (("k", i),))
        for i in range(first, first + count)
    ]


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    await receiver.start()
    yield receiver
    await receiver.stop()


def exporter_to(endpoint: str, **settings: object) -> SpanExporter:
    config = parse_settings(TracingConfig, {"otlp_endpoint": endpoint, **settings})
    return SpanExporter(config, SpanBuffer(capacity=8, batch_size=4, interval=0.05))


async def test_spans_go_to_the_collector_in_batches(receiver: OtlpReceiver) -> None:
    exporter = exporter_to(receiver.endpoint, service_name="edge", headers={"X-Api-Key": "s3cret"})
    exporter.start()
    try:
        exporter.buffer.add(spans(6))  # a full batch at once, the rest after the interval
        await eventually(lambda: len(receiver.spans) == 6, changed=receiver.changed)
        assert [s.span_id for s in receiver.spans] == [f"{i:016x}" for i in range(1, 7)]
        assert {s.service_name for s in receiver.spans} == {"edge"}
        assert receiver.spans[0].attributes == {"k": 1}
        assert len(receiver.requests) == 2
        assert receiver.requests[0]["X-Api-Key"] == "s3cret"
        assert receiver.requests[0]["Content-Type"] == "application/x-protobuf"
        exporter.buffer.add(spans(1, first=7))
    finally:
        await exporter.stop()  # what is left goes before it stops
    assert len(receiver.spans) == 7
    assert (exporter.exported, exporter.buffer.dropped, exporter.failures) == (7, 0, 0)


async def test_a_collector_that_is_down_costs_the_spans_of_its_batches() -> None:
    exporter = exporter_to(f"http://127.0.0.1:{free_port()}")
    exporter.start()
    try:
        exporter.buffer.add(spans(4))
        await eventually(lambda: exporter.buffer.dropped == 4)
        exporter.buffer.add(spans(12))  # 8 fit: 4 more dropped at once
        assert exporter.buffer.dropped == 8
    finally:
        await exporter.stop()
    assert exporter.buffer.dropped == 16
    assert exporter.exported == 0


async def test_a_refusing_collector_costs_the_spans_of_its_batches(
    receiver: OtlpReceiver,
) -> None:
    receiver.status = 503
    exporter = exporter_to(receiver.endpoint)
    exporter.start()
    try:
        exporter.buffer.add(spans(4))
        await eventually(lambda: exporter.failures == 1)  # after the answer: no signal of its own
        assert exporter.buffer.dropped == 4
        receiver.status = 200  # back: the next batch goes
        exporter.buffer.add(spans(4, first=5))
        await eventually(lambda: exporter.exported == 4)
    finally:
        await exporter.stop()
    assert exporter.buffer.dropped == 4


async def test_a_slow_collector_times_out_and_the_buffer_stays_bounded(
    receiver: OtlpReceiver,
) -> None:
    receiver.hold = True  # never answers
    exporter = exporter_to(receiver.endpoint, timeout="200ms")
    exporter.start()
    try:
        exporter.buffer.add(spans(4))
        await eventually(lambda: receiver.requests)  # the export waits on the receiver
        exporter.buffer.add(spans(20, first=5))  # meanwhile: 8 held, 12 dropped
        assert (len(exporter.buffer), exporter.buffer.dropped) == (8, 12)
        await eventually(lambda: exporter.failures >= 1)  # the timeout: its 4 dropped
        assert exporter.buffer.dropped >= 16
    finally:
        await exporter.stop()
    assert exporter.exported == 0
    assert exporter.buffer.dropped == 24  # every span either exported or counted
