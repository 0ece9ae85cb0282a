"""The request path, from a client's socket to an upstream's and back.

    client      ClientConnection: one client connection (parse, limit, time out, pipeline)
    handler     Proxy: each request routed, sent upstream, retried, answered and recorded
    connector   connections to upstreams, and their keep-alive pool
    streams     what both connection sides share: bodies between them, back-pressure
    websocket   the relay of an upgraded connection

The client side and the upstream side never import each other (``streams``).
"""

from .. import native

native.use_in(__path__, __name__)  # first: the compiled modules, if built (native.py)

from .handler import Proxy  # noqa: E402

__all__ = ["Proxy"]
