"""``wire.http2.control_frames``: the control frames among those the gateway writes."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
from hyperframe.frame import PingFrame, RstStreamFrame, SettingsFrame

from gateway.wire.http2 import control_frames


def test_control_frames_are_counted_among_what_is_written() -> None:
    """PING, SETTINGS and RST_STREAM count; HEADERS, DATA, WINDOW_UPDATE and GOAWAY do not,
    whatever their length."""
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()  # SETTINGS
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "GET"), (":path", "/"), (":scheme", "http"),
                            (":authority", "a")])  # fmt: skip
    server.receive_data(client.data_to_send())  # a SETTINGS acknowledgement made
    server.send_headers(1, [(":status", "200")])
    server.send_data(1, b"x" * 1000)
    server.acknowledge_received_data(0, 1)
    server.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    ping = PingFrame(0)
    ping.flags.add("ACK")
    written = server.data_to_send() + ping.serialize() + RstStreamFrame(3).serialize()
    assert control_frames(written) == 5  # SETTINGS twice, RST_STREAM twice, PING
    server.close_connection()
    assert control_frames(server.data_to_send()) == 0  # GOAWAY
    assert control_frames(SettingsFrame(0).serialize()[:8]) == 0  # no whole frame
