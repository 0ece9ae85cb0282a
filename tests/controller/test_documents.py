"""``controller/documents.py``: YAML and JSON documents parsed within limits.

Each bomb is refused with the limit it passes, before it is built and in well under a
second; a document just under the limits (aliases expanded to just under them too) is taken
as ``yaml.safe_load`` or ``json.loads`` reads it. The same limits hold for the gateway config
file and for ``gateway apply -f``.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import yaml

from controller import cli
from controller.config import ConfigError, load_config
from controller.documents import MAX_DEPTH, MAX_INTEGER, MAX_NODES, PAUSE_EVERY, Kind, parse
from controller.errors import DocumentError, DocumentTooLarge
from controller.main import build_parser
from tests.bombs import FLAT_MIB, alias_bomb
from tests.support.ports import free_port

UNBOUNDED = 5.0
"""Seconds that tell a parse bounded by the limits from an unbounded one (a bomb is never
done; 1 MB of a base-60 integer took 16 s): a bound on a shared machine, not a speed figure,
which bench/ measures."""


def nested(depth: int, kind: Kind) -> str:
    """A document ``depth`` levels deep: mappings of one key, a scalar at the bottom."""
    if kind == "json":
        return '{"a": ' * (depth - 1) + "1" + "}" * (depth - 1)
    return "".join(" " * i + "a:\n" for i in range(depth - 2)) + " " * (depth - 2) + "a: 1\n"


def flat(nodes: int) -> str:
    """A list of ``nodes - 1`` numbers: ``nodes`` nodes, the list counted (JSON, and YAML's
    flow style)."""
    return "[" + ",".join(["0"] * (nodes - 1)) + "]"


def refused(text: str | bytes, kind: Kind) -> DocumentTooLarge:
    started = time.perf_counter()
    with pytest.raises(DocumentTooLarge) as caught:
        parse(text, kind)
    assert time.perf_counter() - started < UNBOUNDED
    return caught.value


# -- bombs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("levels", "size"), [(9, 324), (7, 254), (5, 184)])
def test_an_alias_bomb_is_refused_at_the_node_limit(levels: int, size: int) -> None:
    # 9 levels: 387 million leaves (issue 53: the gateway grew past 4 GB and never answered);
    # 7: 4.8 million (17.5 s of stalled traffic); 5: 59,049, the first past the limit.
    text = alias_bomb(levels)
    assert len(text) == size
    error = refused(text, "yaml")
    assert (error.limit, error.allowed, error.status, error.code) == (
        "nodes", MAX_NODES, 413, "document_too_large"
    )  # fmt: skip
    assert error.details == {"limit": "nodes", "allowed": MAX_NODES}
    assert "an alias counts as all it repeats" in error.message
    four = alias_bomb(4)  # 6,561 leaves, 8,307 nodes in all: taken
    assert parse(four, "yaml") == yaml.safe_load(four)


@pytest.mark.parametrize(
    "text",
    ["a: &a [*a]", "a: &a {b: [1, {c: *a}]}", "- &x\n  - *x\n"],
    ids=["list", "map", "block"],
)
def test_an_alias_inside_its_own_anchor_is_nested_without_end(text: str) -> None:
    error = refused(text, "yaml")
    assert error.limit == "depth"
    assert "inside its own anchor" in error.message


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("[" * 20_000, "yaml"),  # the 20 KB one
        ("[" * 10_000 + "]" * 10_000, "yaml"),
        ("{a: " * 5_000 + "}" * 5_000, "yaml"),
        (nested(MAX_DEPTH + 1, "yaml"), "yaml"),
        ("- " * 1_000 + "x", "yaml"),
        ("[" * 100_000, "json"),
        ('{"a": ' * 100_000, "json"),
        ("[" * 900 + "]" * 900, "json"),
        (nested(MAX_DEPTH + 1, "json"), "json"),
    ],
    ids=lambda v: v if v in ("yaml", "json") else None,
)
def test_deep_nesting_is_refused_at_the_depth_limit(text: str, kind: Kind) -> None:
    error = refused(text, kind)
    assert (error.limit, error.allowed) == ("depth", MAX_DEPTH)
    assert error.message == f"nested deeper than {MAX_DEPTH} levels"


@pytest.mark.parametrize("kind", ["yaml", "json"])
def test_many_nodes_are_refused_at_the_node_limit(kind: Kind) -> None:
    assert refused(flat(MAX_NODES + 1), kind).limit == "nodes"
    # A mebibyte of them: refused as soon as the limit is passed, not after reading them all.
    many = "[" + ",".join(["[]"] * 349_000) + "]"
    assert refused(many, kind).limit == "nodes"
    keys = "\n".join(f"k{i}: {i}" for i in range(MAX_NODES // 2 + 1))
    assert refused(keys, "yaml").limit == "nodes"


def test_aliases_count_as_what_they_repeat() -> None:
    anchor = "[" + ",".join(["0"] * 999) + "]"  # 1,000 nodes
    lines = [f"a: &a {anchor}"]  # with the top mapping: 1,002 nodes
    lines += [f"k{i}: *a" for i in range((MAX_NODES - 1_002) // 1_001)]  # 1,001 each
    nodes = 1_002 + 1_001 * (len(lines) - 1)
    lines += [f"p{i}: 0" for i in range((MAX_NODES - nodes) // 2)]
    text = "\n".join(lines)
    assert len(lines) == 1 + 18 + 490  # 1,002 + 18 * 1,001 + 490 * 2: exactly the limit
    assert parse(text, "yaml") == yaml.safe_load(text)
    assert refused(text + "\nz: 0", "yaml").limit == "nodes"  # one key and one value more
    assert refused(text + "\nz: *a", "yaml").limit == "nodes"
    # Depth too: what an alias stands for is as deep at the alias as at its anchor.
    deep = f"a: &a {nested(MAX_DEPTH - 1, 'json')}\nb: *a\n"
    assert parse(deep, "yaml") == yaml.safe_load(deep)
    assert refused(deep.replace("b: *a", "b: [*a]"), "yaml").limit == "depth"


# -- within the limits ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["yaml", "json"])
def test_a_document_at_the_limits_is_taken_as_it_reads(kind: Kind) -> None:
    for text in (flat(MAX_NODES), nested(MAX_DEPTH, kind)):
        started = time.perf_counter()
        data = parse(text, kind)
        assert time.perf_counter() - started < UNBOUNDED  # the largest document allowed
        assert data == (json.loads(text) if kind == "json" else yaml.safe_load(text))
    assert refused(flat(MAX_NODES + 1), kind).limit == "nodes"
    assert refused(nested(MAX_DEPTH + 1, kind), kind).limit == "depth"


def test_json_punctuated_past_the_limit_in_its_strings_is_taken() -> None:
    # The count of brackets, commas and colons only bounds the nodes from above.
    text = json.dumps({"env": {"CSV": ",:[{" * (MAX_NODES + 1)}})
    assert parse(text, "json") == json.loads(text)


def test_yaml_features_within_the_limits_are_kept() -> None:
    text = (
        "probe: &probe {type: http, path: /healthz}\n"
        "probes: [*probe, *probe]\n"
        "base: &base {replicas: 2, route: {path_prefix: /}}\n"
        "web:\n  <<: *base\n  replicas: 3\n"
    )
    data = parse(text, "yaml")
    assert data == yaml.safe_load(text)
    assert data["web"] == {"replicas": 3, "route": {"path_prefix": "/"}}


@pytest.mark.parametrize(
    ("text", "kind", "message"),
    [
        (b"\xff\xfe", "json", "not UTF-8"),
        ("{not json", "json", "not valid JSON: "),
        ("1" * 5_000, "json", "not valid JSON: "),
        ("a: [b", "yaml", "not valid YAML: "),
        ("a: *nowhere", "yaml", "not valid YAML: "),
        ("a: 2026-13-40", "yaml", "not valid YAML: "),
        ("a: 1" + ":0" * 500_000, "yaml", f"longer than {MAX_INTEGER} characters"),
        ("a: 1\n---\nb: 2\n", "yaml", "not valid YAML: "),
    ],
    ids=["utf8", "json", "int", "yaml", "undefined_alias", "date", "base60", "two"],
)
def test_what_is_not_a_document_is_a_document_error(
    text: str | bytes, kind: Kind, message: str
) -> None:
    # A base-60 integer (1:0:0:...) is built in quadratic time: 1 MB of one took 16 s.
    started = time.perf_counter()
    with pytest.raises(DocumentError) as caught:
        parse(text, kind)
    assert time.perf_counter() - started < UNBOUNDED
    assert not isinstance(caught.value, DocumentTooLarge)
    assert (caught.value.status, caught.value.code) == (400, "bad_request")
    assert message in caught.value.message


@pytest.mark.parametrize("kind", ["yaml", "json"])
def test_pause_is_called_every_so_many_nodes(kind: Kind) -> None:
    # A parse in a thread beside an event loop hands it the GIL through ``pause``.
    calls: list[None] = []
    parse(flat(10_000), kind, pause=lambda: calls.append(None))
    assert len(calls) >= 10_000 // PAUSE_EVERY  # the events, or the walk of what was built
    calls.clear()
    with pytest.raises(DocumentTooLarge):
        parse(FLAT_MIB[1], kind, pause=lambda: calls.append(None))
    # The events of "[]," are two a node: refused after 2 * MAX_NODES of them at most.
    assert MAX_NODES // PAUSE_EVERY <= len(calls) <= 2 * MAX_NODES // PAUSE_EVERY + 1


# -- config files and gateway apply -f --------------------------------------------------------


def test_a_config_file_past_a_limit_names_the_file_and_the_limit(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(alias_bomb(9))
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert str(caught.value) == (
        f"{config}: refused: larger than {MAX_NODES} nodes (keys and values; an alias counts "
        "as all it repeats) (limit: nodes)"
    )
    spec = tmp_path / "web.json"
    spec.write_text("[" * 20_000)
    config.write_text("services: [web.json]\n")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert str(caught.value) == (
        f"{spec}: refused: nested deeper than {MAX_DEPTH} levels (limit: depth)"
    )


async def test_gateway_apply_refuses_a_bomb_before_it_calls_the_gateway(tmp_path: Path) -> None:
    bomb = tmp_path / "web.yaml"
    bomb.write_text(alias_bomb(9))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: it is not called
    args = build_parser().parse_args(["apply", "-f", str(bomb), "--admin", url, "--token", "t"])
    out, err = io.StringIO(), io.StringIO()
    assert await cli.run_command(args, out, err) == 2
    assert err.getvalue().startswith(f"gateway: {bomb}: refused: larger than {MAX_NODES} nodes")
    assert err.getvalue().endswith("(limit: nodes)\n")
