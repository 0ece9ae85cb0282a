"""How a settings field states its checks to pydantic (``gateway.config``), without importing
it: pydantic is imported when a schema is built, in the controller's process, never in a
worker's, which only receives the settings.

    Check     a function run on the field's value, before or after the type's own validation
    Pattern   a str field matched by a regular expression, as ``Field(pattern=...)``
    Ge Gt Le  a number field's bounds, as annotated_types' classes of the same names
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:
    from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
    from pydantic.json_schema import JsonSchemaValue
    from pydantic_core import CoreSchema


class Check:
    """A check (or normalisation) of a field's value, run by pydantic when it validates the
    dataclass: ``before`` on the raw input, else after the type's own validation. pydantic is
    imported only when a schema is built (in the controller's process, never a worker's)."""

    __slots__ = ("before", "fn")

    def __init__(self, fn: Callable[[Any], Any], *, before: bool = False) -> None:
        self.fn = fn
        self.before = before

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        from pydantic_core import core_schema

        if self.before:
            return core_schema.no_info_before_validator_function(self.fn, handler(source))
        return core_schema.no_info_after_validator_function(self.fn, handler(source))


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
    annotated_types' class of the same name: on a number's schema, the schema's own
    constraint; on any other (a duration's check of its text), a check after it, with the
    same error, and the bound in the JSON schema. annotated_types (with typing_extensions and
    datetime, 0.5 MiB of a worker that only receives the settings) is never imported."""

    __slots__ = ("value",)
    key: ClassVar[str]
    error: ClassVar[str]

    def __init__(self, value: float) -> None:
        self.value = value

    def holds(self, value: float) -> bool:
        raise NotImplementedError

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        schema: dict[str, Any] = dict(handler(source))
        if schema["type"] in ("int", "float"):
            schema[self.key] = self.value
            return cast("CoreSchema", schema)
        from pydantic_core import PydanticKnownError, core_schema

        def check(value: Any) -> Any:
            if not self.holds(value):
                raise PydanticKnownError(self.error, {self.key: self.value})  # type: ignore[arg-type]
            return value

        return core_schema.no_info_after_validator_function(check, cast("CoreSchema", schema))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json = handler(schema)
        if schema["type"] not in ("int", "float"):
            json[self.key] = self.value
        return json

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


class Ge(_Bound):
    key = "ge"
    error = "greater_than_equal"

    def holds(self, value: float) -> bool:
        return value >= self.value


class Gt(_Bound):
    key = "gt"
    error = "greater_than"

    def holds(self, value: float) -> bool:
        return value > self.value


class Le(_Bound):
    key = "le"
    error = "less_than_equal"

    def holds(self, value: float) -> bool:
        return value <= self.value
