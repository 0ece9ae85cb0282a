"""The request path, from a client's socket to an upstream's and back.

    codec                Downstream: a client's side of a request whatever its HTTP
                         version (the seam: the rest of the request path calls only it)
    http1_downstream     ClientConnection: a client's connection over HTTP/1.1: reads its
                         requests (parse, limit, time out, splice large bodies), runs
                         them in turn, writes the answers, closes
    h2_downstream        H2Connection: a client's connection over HTTP/2 (on h2), taken
                         over at the h2c preface or by ALPN h2: its streams' requests
    h2_stream            H2Stream: one HTTP/2 stream's Downstream, flow control both ways
    limits, wheel        a listener's limits as it reads them; the deadlines of the
                         connections that wait for a request, in one timer's slots
    parking              idle connections held out of the loop, their sockets alone, until
                         their clients send again
    request              a request as the client sent it: its head, its body, head rules
    handler              Proxy: begin (without a task) or handle (as a task) each request
    exchange             Exchange: one request's owner, across its attempts, on both ways
    routing, retry       where a request goes; whether a failed attempt is tried again
    messages             the heads the proxy writes, and its own JSON answers
    connector            the keep-alive pool of connections to upstreams
    upstream_connection  UpstreamConnection: one request at a time to one upstream
    streams              what both connection sides share: bodies between them, back-pressure
    websocket            the relay of an upgraded connection

The client side (codec, http1_downstream, h2_downstream, h2_stream, request) and the
upstream side (connector, upstream_connection) never import each other (``streams``).
"""

from .. import native

native.use_in(__path__, __name__)  # first: the compiled modules, if built (native.py)

from .handler import Proxy  # noqa: E402

__all__ = ["Proxy"]
