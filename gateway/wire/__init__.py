"""HTTP on the wire, for both connection sides of the proxy.

http1       framing, response heads, the gateway's own answers, head limits
http2       the HTTP/2 preface; an answer's HTTP/2 fields, from HTTP/1.1's lines
plainhead   the compiled reader of the plainest heads (llhttp reads every other)
headers     which fields pass, which are dropped or added, both ways
splice      large bodies read straight into buffers the other side writes from
batch       the writes of one loop turn, flushed together
upstream_tls  TLS to the replicas: a client context per config, ALPN's check (interpreted)
"""

from .. import native

native.use_in(__path__, __name__)  # first: the compiled modules, if built (native.py)
