"""``H2Client``: an HTTP/2 client on one loopback connection, for tests (the ``h2`` library's
state machine over asyncio streams), where curl cannot say or do enough: several streams at
once, windows kept shut, GOAWAY seen, frames the gateway should refuse.

Each stream's answer is collected in an ``Answer``; ``read`` takes frames until a condition
holds (``until``) or the gateway closes; nothing sleeps. Once the gateway sent GOAWAY, frames
are read without ``h2``'s state machine (which takes none after a GOAWAY, where RFC 9113 6.8
lets the streams it left open finish).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.settings
from hyperframe.frame import DataFrame, Frame, HeadersFrame, RstStreamFrame


@dataclass
class Answer:
    """One stream's answer as it came."""

    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    ended: bool = False
    reset: int | None = None
    """The error code of the gateway's RST_STREAM, if it reset the stream."""

    @property
    def status(self) -> int:
        return int(self.headers.get(b":status", b"0"))


class H2Client:
    """One HTTP/2 connection to ``port`` (h2c by prior knowledge unless given a TLS stream)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        window: int | None = None,
        acknowledge: bool = True,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.acknowledge = acknowledge
        """Open the windows again as data is read (False: keep them as they are)."""
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        if window is not None:
            self.conn.local_settings = h2.settings.Settings(
                client=True,
                initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window},
            )
        self.conn.initiate_connection()
        self.answers: dict[int, Answer] = {}
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self.unacknowledged: dict[int, int] = {}
        self._buffer = bytearray()

    @classmethod
    async def connect(cls, port: int, **options: object) -> H2Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer, **options)  # type: ignore[arg-type]
        client.flush()
        return client

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    def request(
        self,
        path: str,
        *,
        method: str = "GET",
        body: bytes | None = None,
        headers: list[tuple[str, str]] | None = None,
        authority: str = "example.test",
        end: bool = True,
    ) -> int:
        """Open a stream with a request (and its body): its id."""
        stream_id = self.conn.get_next_available_stream_id()
        fields = [
            (":method", method),
            (":path", path),
            (":scheme", "http"),
            (":authority", authority),
            *(headers or []),
        ]
        self.conn.send_headers(stream_id, fields, end_stream=end and body is None)
        self.answers[stream_id] = Answer()
        if body is not None:
            self.send_body(stream_id, body, end=end)
        self.flush()
        return stream_id

    def send_body(self, stream_id: int, body: bytes, *, end: bool = True) -> None:
        """As much of ``body`` as the windows allow now (tests send small ones)."""
        self.conn.send_data(stream_id, body, end_stream=end)
        self.flush()

    def open_windows(self) -> None:
        """Acknowledge what was read and kept unacknowledged."""
        for stream_id, size in self.unacknowledged.items():
            self.conn.acknowledge_received_data(size, stream_id)
        self.unacknowledged.clear()
        self.flush()

    async def read(self, until: Callable[[], bool], within: float = 5.0) -> None:
        """Read frames until ``until()`` holds or the gateway closed (``within``: a bound on
        a hang, not a pace)."""
        async with asyncio.timeout(within):
            while not until() and not self.closed:
                data = await self.reader.read(65536)
                if not data:
                    self.closed = True
                    break
                if self.terminated is not None:
                    self._raw(data)
                    continue
                for event in self.conn.receive_data(data):
                    self._event(event)
                self.flush()

    async def get(self, *streams: int, within: float = 5.0) -> list[Answer]:
        """The answers of ``streams``, once each ended or was reset."""
        await self.read(
            lambda: all(
                self.answers[s].ended or self.answers[s].reset is not None for s in streams
            ),
            within,
        )
        return [self.answers[s] for s in streams]

    def _raw(self, data: bytes) -> None:
        """Frames after a GOAWAY: HEADERS, DATA and RST_STREAM of the streams left open."""
        self._buffer += data
        while len(self._buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self._buffer[:9]))
            if len(self._buffer) < 9 + length:
                return
            frame.parse_body(memoryview(self._buffer[9 : 9 + length]))
            del self._buffer[: 9 + length]
            answer = self.answers.get(frame.stream_id)
            if answer is None:
                continue
            if isinstance(frame, HeadersFrame):
                answer.headers = dict(self.conn.decoder.decode(frame.data, raw=True))
            elif isinstance(frame, DataFrame):
                answer.body += frame.data
            elif isinstance(frame, RstStreamFrame):
                answer.reset = frame.error_code
            if "END_STREAM" in frame.flags:
                answer.ended = True

    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.answers[event.stream_id].headers = dict(event.headers or [])
        elif isinstance(event, h2.events.DataReceived):
            self.answers[event.stream_id].body += event.data or b""
            size = event.flow_controlled_length or 0
            if self.acknowledge:
                self.conn.acknowledge_received_data(size, event.stream_id)
            else:
                stream_id = event.stream_id or 0
                self.unacknowledged[stream_id] = self.unacknowledged.get(stream_id, 0) + size
        elif isinstance(event, h2.events.TrailersReceived):
            self.answers[event.stream_id].trailers = dict(event.headers or [])
        elif isinstance(event, h2.events.StreamEnded):
            self.answers[event.stream_id].ended = True
        elif isinstance(event, h2.events.StreamReset):
            self.answers[event.stream_id].reset = event.error_code
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.terminated = event

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass
