"""A YAML or JSON document, parsed within limits.

Every document the controller reads from outside (an admin API body, the gateway config file,
a spec file for ``gateway apply -f``) is parsed here, and refused with ``DocumentTooLarge``,
naming the limit passed, once it is nested deeper than ``MAX_DEPTH`` levels or holds more
than ``MAX_NODES`` nodes (keys, values and collections).

A YAML alias counts as the nodes and depth of what it repeats, and the limits are checked on
the parser's events, before anything is built: an alias bomb (a few hundred bytes that stand
for billions of nodes) is refused after a few dozen events, and an alias inside its own
anchor (a document that contains itself) is nested without end. Aliases within the limits
are taken, as in any YAML file.

Invariants: the cost of ``parse`` grows with the text's length and the limits, never with what
aliases stand for; what it returns has at most ``MAX_NODES`` nodes once expanded, so a caller
can walk, dump and validate it in bounded time. Nothing here blocks on I/O; a caller on an
event loop runs it in a thread, and passes ``pause`` so that the thread hands the loop the
GIL every ``PAUSE_EVERY`` steps instead of making it wait a switch interval (5 ms) at each of
its turns.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from .errors import DocumentError, DocumentTooLarge

__all__ = ["MAX_DEPTH", "MAX_INTEGER", "MAX_NODES", "PAUSE_EVERY", "Kind", "parse"]

MAX_DEPTH = 64
"""Levels of nesting, the document's top value being level 1; a spec needs about 6."""
MAX_NODES = 20_000
"""Keys, values and collections, an alias counting as all it repeats. A spec with every
bounded list at its longest has about 1,500; the demo's, 45."""
MAX_INTEGER = 4300
"""Characters of a YAML integer: Python's own limit on decimal digits (``int("9" * 4301)``
is refused), applied to YAML's base-60 integers too, whose conversion time is quadratic."""

PAUSE_EVERY = 256
"""Steps (parser events, objects built, values walked) between two calls of ``pause``."""

Kind = Literal["yaml", "json"]

_Loader: type[Any] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser where PyYAML was built with it (it is in the project's wheels), with the
safe constructors; the pure-Python parser otherwise."""


class _BoundedLoader(_Loader):  # type: ignore[misc]
    """The safe loader, with integers bounded and ``pause`` called as objects are built."""

    def __init__(self, text: str, pause: Callable[[], object] | None) -> None:
        super().__init__(text)
        self.pause = pause
        self.built = 0

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        self.built += 1
        if self.pause is not None and self.built % PAUSE_EVERY == 0:
            self.pause()
        return super().construct_object(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_INTEGER:
            raise DocumentError(f"not valid YAML: an integer longer than {MAX_INTEGER} characters")
        value: int = super().construct_yaml_int(node)
        return value


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def parse(text: str | bytes, kind: Kind, pause: Callable[[], object] | None = None) -> Any:
    """``text`` (bytes are read as UTF-8) as Python data: dicts, lists and scalars.

    Raises ``DocumentTooLarge`` past a limit, ``DocumentError`` for anything else that is not
    one document of ``kind``. ``pause`` is called every ``PAUSE_EVERY`` steps.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise DocumentError("not UTF-8") from None
    if kind == "json":
        return _json(text, pause)
    return _yaml(text, pause)


def _too_deep() -> DocumentTooLarge:
    return DocumentTooLarge(f"nested deeper than {MAX_DEPTH} levels", "depth", MAX_DEPTH)


def _too_many() -> DocumentTooLarge:
    return DocumentTooLarge(
        f"larger than {MAX_NODES} nodes (keys and values; an alias counts as all it repeats)",
        "nodes",
        MAX_NODES,
    )


def _json(text: str, pause: Callable[[], object] | None) -> Any:
    # json.loads builds the whole document in one call that holds the GIL however long it
    # takes, so an event loop beside it would wait. A count of punctuation bounds the nodes
    # from above; past the limit, the YAML parser's events (JSON is YAML's flow style) count
    # them exactly, pausing, and stop at the limit before json.loads builds anything.
    bound = 1 + sum(text.count(c) for c in "[{,:")
    if bound > MAX_NODES:
        with contextlib.suppress(yaml.YAMLError):  # json.loads is the judge of JSON
            _measure(text, pause)
    try:
        data = json.loads(text)
    except RecursionError:  # the C scanner stops near Python's recursion limit, far past ours
        raise _too_deep() from None
    except ValueError as e:
        raise DocumentError(f"not valid JSON: {e}") from None
    nodes = visited = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        visited += 1
        if pause is not None and visited % PAUSE_EVERY == 0:
            pause()
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(value, dict):
            nodes += 1 + len(value)
            children = value.values()
        elif isinstance(value, list):
            nodes += 1
            children = value  # type: ignore[assignment]
        else:
            nodes += 1
            continue
        if nodes + len(stack) + len(children) > MAX_NODES:  # each child is one node at least
            raise _too_many()
        stack.extend((child, depth + 1) for child in children)
    return data


@dataclass
class _Open:
    """A collection whose end event has not come yet."""

    anchor: str | None
    start: int
    """Nodes counted before it."""
    height: int = 0
    """Levels below it so far."""


def _yaml(text: str, pause: Callable[[], object] | None) -> Any:
    try:
        _measure(text, pause)
        loader = _BoundedLoader(text, pause)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        if "maximum nesting depth" in str(e):  # libyaml's own limit (1000) met by its scanner
            raise _too_deep() from None
        raise DocumentError(f"not valid YAML: {e}") from None
    except ValueError as e:  # a constructor's: a timestamp out of range, ...
        raise DocumentError(f"not valid YAML: {e}") from None


def _measure(text: str, pause: Callable[[], object] | None) -> None:
    """Walk the parser's events, counting nodes and levels as the composed document would
    have them, an alias as its anchor's; stop at the first limit passed."""
    nodes = 0
    open_: list[_Open] = []
    anchors: dict[str, tuple[int, int]] = {}
    """Anchor -> the nodes and levels of what it names."""
    for count, event in enumerate(yaml.parse(text, Loader=_Loader), 1):
        if pause is not None and count % PAUSE_EVERY == 0:
            pause()
        if isinstance(event, yaml.CollectionStartEvent):
            if len(open_) + 1 > MAX_DEPTH:
                raise _too_deep()
            open_.append(_Open(event.anchor, nodes))
            nodes += 1
        elif isinstance(event, yaml.CollectionEndEvent):
            done = open_.pop()
            height = done.height + 1
            if done.anchor is not None:
                anchors[done.anchor] = (nodes - done.start, height)
            if open_:
                open_[-1].height = max(open_[-1].height, height)
        elif isinstance(event, yaml.ScalarEvent | yaml.AliasEvent):
            if isinstance(event, yaml.ScalarEvent):
                size, height = 1, 1
                if event.anchor is not None:
                    anchors[event.anchor] = (1, 1)
            elif any(o.anchor == event.anchor for o in open_):
                raise DocumentTooLarge(
                    f"nested without end: the alias *{event.anchor} is inside its own anchor",
                    "depth",
                    MAX_DEPTH,
                )
            else:  # an undefined alias counts as one node: the composer refuses it
                size, height = anchors.get(event.anchor or "", (1, 1))
            nodes += size
            if len(open_) + height > MAX_DEPTH:
                raise _too_deep()
            if open_:
                open_[-1].height = max(open_[-1].height, height)
        if nodes > MAX_NODES:
            raise _too_many()
