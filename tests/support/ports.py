"""Free loopback ports for the servers a test starts (pebble, etcd, prometheus, replicas).

A port is found by binding port 0 and closing the socket, and the kernel may give the same port
to the very next such bind: two ``free_port()`` calls in a row once returned one port, and
pebble then failed to bind its second listener. So a port is never handed out twice in a
test process.
"""

from __future__ import annotations

import socket

_given: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now, and not handed out before in this process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while True:
        with socket.socket(family) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port
