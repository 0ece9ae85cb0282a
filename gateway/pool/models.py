"""The model table: which service serves the model a request names. PURE.

Built from the services' ``model`` (a name and its aliases) whenever the services change, as
the route table is. A name is one service's: the controller refuses a spec whose model
another service serves already; should two still meet here, the service first by name keeps
it. The list ``GET {prefix}/models`` answers (OpenAI's shape) is made once per table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..config import ModelConfig


def model_entry(model: str, service: str) -> dict[str, object]:
    """One model as OpenAI's API lists it."""
    return {"id": model, "object": "model", "created": 0, "owned_by": service}


@dataclass(frozen=True, slots=True)
class ModelTable:
    services: dict[str, str] = field(default_factory=dict)
    """Each model name and alias -> the service that serves it."""
    listing: bytes = b'{"object":"list","data":[]}'
    """Every model name and alias, as ``GET {prefix}/models`` answers (JSON)."""

    @classmethod
    def build(cls, models: Iterable[tuple[str, ModelConfig]]) -> ModelTable:
        """The table of (service, its model) pairs."""
        services: dict[str, str] = {}
        for service, model in sorted(models, key=lambda pair: pair[0]):
            for name in model.names:
                services.setdefault(name, service)
        data = [model_entry(name, service) for name, service in sorted(services.items())]
        listing = json.dumps({"object": "list", "data": data}, separators=(",", ":"))
        return cls(services, listing.encode())

    def service(self, model: str) -> str | None:
        """The service that serves ``model``, or None."""
        return self.services.get(model)

    def __repr__(self) -> str:
        return f"<ModelTable models={len(self.services)}>"
