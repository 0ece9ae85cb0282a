"""The base of the controller's own config models (pydantic). The data plane's settings
(``gateway.config``) are plain dataclasses, so that a worker process never imports pydantic."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    """Base of every config model: immutable, strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")
