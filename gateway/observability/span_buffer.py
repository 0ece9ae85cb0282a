"""Finished spans waiting to leave: a bounded queue and when its next batch is due. PURE.

A worker's buffer is sent to the main process (``workers``), the main process's exported
(``exporter``), a batch at a time. The request path only ever adds: a span that does not fit
is dropped and counted (``dropped``), so a slow or absent collector never holds a request
up, nor grows the memory. A batch is due when ``batch_size`` spans wait, or when spans have
waited ``interval`` seconds since the last batch was taken (``due``, given ``now``).

Invariant: every span added is either taken or counted in ``dropped``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .spans import Span


class SpanBuffer:
    """At most ``capacity`` spans, taken ``batch_size`` at a time. ``wake`` is called when a
    batch fills (once until it is taken): the driver that takes them waits for it."""

    def __init__(
        self,
        capacity: int = 2048,
        batch_size: int = 512,
        interval: float = 1.0,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.batch_size = batch_size
        self.interval = interval
        self.wake = wake
        self.spans: list[Span] = []
        self.dropped = 0
        """Spans dropped: the buffer was full, or a batch taken could not be delivered
        (``lost``)."""
        self.taken_at = 0.0
        """When the last batch was taken (the driver's clock)."""
        self._woken = False

    def add(self, spans: Sequence[Span]) -> None:
        """Spans finished (on the request path: never blocks)."""
        held = self.spans
        room = self.capacity - len(held)
        if len(spans) > room:
            self.dropped += len(spans) - max(room, 0)
            spans = spans[: max(room, 0)]
        held.extend(spans)
        if len(held) >= self.batch_size and not self._woken:
            self._woken = True
            wake = self.wake
            if wake is not None:
                wake()

    def lost(self, count: int) -> None:
        """``count`` spans taken could not be delivered: dropped."""
        self.dropped += count

    def discard(self) -> None:
        """Drop (and count) every span held: they will not leave."""
        self.dropped += len(self.spans)
        self.spans.clear()
        self._woken = False

    def due(self, now: float) -> bool:
        """Whether a batch should be taken now."""
        held = len(self.spans)
        return held >= self.batch_size or (held > 0 and now - self.taken_at >= self.interval)

    def until_due(self, now: float) -> float:
        """Seconds until a batch is due if nothing more is added (0: due now)."""
        if self.due(now):
            return 0.0
        return max(self.taken_at + self.interval - now, 0.0) or self.interval

    def take(self, now: float) -> list[Span]:
        """The next batch (at most ``batch_size`` spans, oldest first)."""
        held = self.spans
        batch = held[: self.batch_size]
        del held[: self.batch_size]
        self.taken_at = now
        self._woken = len(held) >= self.batch_size
        return batch

    def __len__(self) -> int:
        return len(self.spans)

    def __repr__(self) -> str:
        return (
            f"<SpanBuffer held={len(self.spans)}/{self.capacity} dropped={self.dropped}"
            f" batch={self.batch_size}>"
        )
