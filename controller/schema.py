"""The base of the controller's own config models (pydantic). The data plane's settings
(``gateway.config``) are plain dataclasses, so that a worker process never imports pydantic.

A model states each of its checks in the JSON schema pydantic makes of it (the admin API's
document is generated from it): a constraint pydantic knows (``Field(ge=..., pattern=...)``)
states itself; a validator's rule is stated beside it, with ``on_branch`` for one field and
``__get_pydantic_json_schema__`` for a rule across fields.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict
from pydantic.config import JsonDict, JsonValue


class Model(BaseModel):
    """Base of every config model: immutable, strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def on_branch(json_type: str, **keywords: JsonValue) -> Callable[[JsonDict], None]:
    """A field's ``json_schema_extra`` that adds ``keywords`` to its schema, or, for a union
    (``str | None``), to the branch of that JSON type."""

    def extra(schema: JsonDict) -> None:
        options = schema.get("anyOf")
        if isinstance(options, list):
            for option in options:
                if isinstance(option, dict) and option.get("type") == json_type:
                    option.update(keywords)
        else:
            schema.update(keywords)

    return extra
