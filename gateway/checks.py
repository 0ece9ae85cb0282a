"""How a settings field states its checks to pydantic (``gateway.config``), without importing
it: pydantic is imported when a schema is built, in the controller's process, never in a
worker's, which only receives the settings.

    Check     a function run on the field's value, before or after the type's own validation,
              with what it checks stated in JSON Schema (``json_schema``) for the documents
              generated from the schema (the admin API's OpenAPI document)
    Pattern   a str field matched by a regular expression, as ``Field(pattern=...)``
    Ge Gt Le  a number field's bounds, as annotated_types' classes of the same names (a
              duration's too: bound its number, then ``Check`` its text, ``config.Duration``)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:
    from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
    from pydantic.json_schema import JsonSchemaValue
    from pydantic_core import CoreSchema


class Check:
    """A check (or normalisation) of a field's value, run by pydantic when it validates the
    dataclass: ``before`` on the raw input, else after the type's own validation. pydantic is
    imported only when a schema is built (in the controller's process, never a worker's).

    ``json_schema`` states the check in JSON Schema (2020-12, with ECMA-262 patterns): keywords
    added to the value's schema (to its non-null part, for an optional field), or a function
    that returns the schema from the type's own."""

    __slots__ = ("before", "fn", "json_schema")

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        before: bool = False,
        json_schema: Mapping[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.fn = fn
        self.before = before
        self.json_schema = json_schema

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        from pydantic_core import core_schema

        if self.before:
            return core_schema.no_info_before_validator_function(self.fn, handler(source))
        return core_schema.no_info_after_validator_function(self.fn, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json = handler(schema)
        if callable(self.json_schema):
            return self.json_schema(json)
        if self.json_schema is not None:
            options = [o for o in json.get("anyOf", ()) if o.get("type") != "null"]
            for part in options if "type" not in json and options else [json]:
                part.update(self.json_schema)
        return json


class Pattern:
    """A str field (or ``str | None``) matched by ``pattern``, as pydantic's
    ``Field(pattern=...)``: its error text, and the pattern in the JSON schema."""

    __slots__ = ("pattern",)

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        schema: dict[str, Any] = dict(handler(source))
        if schema["type"] == "nullable":  # str | None: the pattern is the str's
            schema["schema"] = {**schema["schema"], "pattern": self.pattern}
        else:
            schema["pattern"] = self.pattern
        return cast("CoreSchema", schema)


class _Bound:
    """A bound of a number field (``Ge``, ``Gt``, ``Le``) stated to pydantic as it states
    annotated_types' class of the same name: the number schema's own constraint, so its error
    and its JSON Schema are pydantic's. annotated_types (with typing_extensions and datetime,
    memory a worker that only receives the settings never uses) is never imported."""

    __slots__ = ("value",)
    key: ClassVar[str]

    def __init__(self, value: float) -> None:
        self.value = value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        schema: dict[str, Any] = dict(handler(source))
        if schema["type"] not in ("int", "float"):
            raise TypeError(f"{self!r} bounds a number, not a {schema['type']} schema")
        schema[self.key] = self.value
        return cast("CoreSchema", schema)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


class Ge(_Bound):
    key = "ge"


class Gt(_Bound):
    key = "gt"


class Le(_Bound):
    key = "le"
