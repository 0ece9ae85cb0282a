"""A listener's limits as the request path reads them (``Limits``): plain attributes, one
object shared by the listener's connections (``limits_of``)."""

from __future__ import annotations

from typing import Final

from ..config import ListenerLimits


class Limits:
    """A listener's ``ListenerLimits`` as plain attributes, one object shared by its
    connections: a field of a config model is read through pydantic's ``__getattr__`` hook,
    a slow attribute, and every request reads some."""

    __slots__ = (
        "body_min_rate",
        "body_timeout",
        "header_timeout",
        "keepalive_timeout",
        "max_header_size",
        "park_after",
        "send_timeout",
    )

    def __init__(self, limits: ListenerLimits) -> None:
        self.max_header_size = limits.max_header_size
        self.header_timeout = limits.header_timeout
        self.keepalive_timeout = limits.keepalive_timeout
        self.park_after = (
            limits.park_after if 0 < limits.park_after < limits.keepalive_timeout else 0.0
        )
        """``ListenerLimits.park_after``; 0 if never (or not before the keep-alive deadline)."""
        self.body_timeout = limits.body_timeout
        self.body_min_rate = limits.body_min_rate
        self.send_timeout = limits.send_timeout


class _LastLimits:
    """The ``Limits`` made last, and of what (a listener's connections share one)."""

    of: ListenerLimits | None = None
    limits: Limits | None = None


_last_limits: Final = _LastLimits()


def limits_of(config: ListenerLimits) -> Limits:
    """The ``Limits`` of ``config``: the last one made, if it was made of it."""
    last = _last_limits
    limits = last.limits
    if limits is None or last.of is not config:
        limits = last.limits = Limits(config)
        last.of = config
    return limits
