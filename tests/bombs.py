"""Documents that cost far more to build than to send (issue 53), for the tests of
``controller/documents.py`` and of the admin API under traffic (``tests/hostile``)."""

from __future__ import annotations

import string


def alias_bomb(levels: int, width: int = 9) -> str:
    """ "Billion laughs": each level a list of ``width`` aliases of the level before, so
    ``levels`` levels stand for ``width ** levels`` leaves (9 levels: 324 bytes)."""
    names = string.ascii_lowercase
    lines = [f"a: &a [{','.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"{names[i]}: &{names[i]} [{','.join(['*' + names[i - 1]] * width)}]")
    return "\n".join(lines) + "\n"


YAML = "application/yaml"
JSON = "application/json"

BOMBS: dict[str, tuple[str, str]] = {
    "alias_9_levels": (YAML, alias_bomb(9)),  # 324 bytes: RSS past 4 GB, never answered
    "alias_7_levels": (YAML, alias_bomb(7)),  # 254 bytes: traffic stalled 17.5 s
    "alias_in_its_anchor": (YAML, "name: web\nreplica: &r {commands: [*r]}\n"),
    "yaml_nested_20kb": (YAML, "[" * 20_000),  # refused with 400, traffic stalled ~3 s
    "yaml_nested_block": (YAML, "".join(" " * i + "a:\n" for i in range(200))),
    "json_nested_20kb": (JSON, "[" * 20_000),
    "json_objects_nested": (JSON, '{"replica": ' * 50_000),
}
"""Name -> (content type, body): each refused with 413 after a few dozen nodes or levels."""

FLAT_MIB = (JSON, "[" + ",".join(["[]"] * 349_000) + "]")
"""No bomb (its cost grows with its length, not faster) but the costliest body under the
admin API's 1 MiB to refuse: 349,000 nodes, refused at the node limit."""
