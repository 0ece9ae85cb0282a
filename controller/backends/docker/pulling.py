"""Pull progress: the ``POST /images/create`` stream summed over the image's layers. Pure.

The engine streams one JSON message per change of one layer (``id``): ``Pulling fs layer``,
``Waiting``, ``Downloading`` with ``progressDetail: {current, total}`` (bytes), ``Verifying
Checksum``, ``Download complete``, ``Extracting``, ``Pull complete``, or ``Already exists``.
Other messages (``Pulling from ...`` whose id is the tag, ``Digest``, ``Status``) are no layer.
A layer's bytes count as downloaded once its download completed, whatever came before; a
layer that already exists counts as done with no bytes to fetch. ``due`` throttles what is
said to one line every ``every`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LAYER_STATUSES = frozenset(
    {
        "Pulling fs layer",
        "Waiting",
        "Downloading",
        "Verifying Checksum",
        "Download complete",
        "Extracting",
        "Pull complete",
        "Already exists",
    }
)
DOWNLOADED = frozenset({"Download complete", "Extracting", "Pull complete", "Already exists"})
SAY_EVERY = 2.0
"""Seconds between two progress lines of one pull."""


@dataclass
class Layer:
    current: int = 0
    total: int = 0
    downloaded: bool = False


@dataclass
class PullProgress:
    """One pull of ``image`` on ``host`` for a replica of ``service``, fed the engine's
    messages in order."""

    image: str
    host: str
    service: str = ""
    layers: dict[str, Layer] = field(default_factory=dict)
    said_at: float | None = None

    def feed(self, message: dict[str, Any]) -> None:
        status, layer_id = message.get("status"), message.get("id")
        if status not in LAYER_STATUSES or not isinstance(layer_id, str):
            return
        layer = self.layers.setdefault(layer_id, Layer())
        detail = message.get("progressDetail") or {}
        if status == "Downloading":
            current, total = detail.get("current"), detail.get("total")
            if isinstance(current, int) and current >= 0:
                layer.current = current
            if isinstance(total, int) and total > 0:
                layer.total = total
        elif status in DOWNLOADED:
            layer.downloaded = True
            layer.current = layer.total if status != "Already exists" else 0
            if status == "Already exists":
                layer.total = 0

    @property
    def done(self) -> int:
        return sum(1 for layer in self.layers.values() if layer.downloaded)

    @property
    def current(self) -> int:
        return sum(min(layer.current, layer.total) for layer in self.layers.values())

    @property
    def total(self) -> int:
        return sum(layer.total for layer in self.layers.values())

    def text(self) -> str:
        """``pulling web:2 on a: 3 of 5 layers, 12.5 of 80.0 MB``."""
        sizes = f", {self.current / 1e6:.1f} of {self.total / 1e6:.1f} MB" if self.total else ""
        layers = f"{self.done} of {len(self.layers)} layers"
        return f"pulling {self.image} on {self.host}: {layers}{sizes}"

    def due(self, now: float, every: float = SAY_EVERY) -> bool:
        """Whether a line is due at ``now`` (the first one at once); marks it said."""
        if self.said_at is not None and now - self.said_at < every:
            return False
        self.said_at = now
        return True
