"""What the admin API enforces that pydantic's JSON schemas do not say, written into them.

The spec models check much in validators (a command is not blank, a route has hosts or a
prefix, a process replica has a command...), which pydantic cannot describe. ``add`` states
each of those rules in the document's component schemas, in JSON Schema 2020-12, so that a
request the document allows is one the API takes, and the other way round. The fuzz in
tests/hostile holds the two to that, from both sides.

Invariant: a rule here is the same rule as the validator it names; a pattern here means what
the validator's check means (``$`` is the end of the string, as in ECMA-262).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..scaling import MAX_REPLICAS
from ..spec import (
    DOCKER_FIELDS,
    ENV_NAME_PATTERN,
    MAX_COMMAND_LENGTH,
    MAX_COMMANDS,
    MAX_ENV,
    MAX_ENV_VALUE,
    MAX_RATE_LIMITS,
)

Schema = dict[str, Any]

SPACE = (
    "\\u0009-\\u000d\\u001c-\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029"
    "\\u202f\\u205f\\u3000"
)
"""What ``str.isspace`` (so ``str.strip``) takes for white space, as the body of a regex class:
ECMA-262's ``\\s`` is another set."""
NOT_BLANK = f"^[^\\u0000]*[^\\u0000{SPACE}][^\\u0000]*$"
"""A command: something besides whitespace (``str.strip``'s), and no NUL."""
NO_NUL = "^[^\\u0000]*$"
ABSOLUTE_PATH = "^/"
HOST = (
    r"^(?=.{1,253}\.*$)(\*\.)?[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
    r"(\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*\.*$"
)
"""A host name or ``*.suffix``, in any case, trailing dots allowed: at most 253 characters
without them (``gateway.config.RouteConfig._hosts``)."""
PATH_PREFIX = r"^(?!.*//)(?!(.*/)?\.\.?(/|$))/[^?#\\ \t\r\n%]*$"
"""Starts with '/', no '?', '#', '%', '\\' or space, no '.' or '..' segment, no '//'."""
PROBE_PATH = r"^/[^\r\n ]*$"
HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}$"
HEADER_VALUE = r"^[^\u0000-\u0008\u000a-\u001f\u007f]*$"
PORT = r"0*([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
ADDRESS = rf"^(\[[^{SPACE}]+\]|[^:\[\]{SPACE}]+):{PORT}$"
"""``host:port``, an IPv6 host in brackets (``gateway.config.parse_address``)."""
ASCII_SPACE = r"[\t\n\v\f\r ]"
"""``\\s`` under ``re.ASCII``, as the duration parser reads it (ECMA-262's ``\\s`` is wider)."""
POSITIVE_DURATION = (
    rf"^{ASCII_SPACE}*([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)"
    rf"{ASCII_SPACE}*(ms|s|m|h)?{ASCII_SPACE}*$"
)


def add(schemas: dict[str, Schema], backends: Iterable[str]) -> None:
    """Write the validators' rules into ``schemas`` (the document's components).

    ``backends``: the backends this gateway has; a spec naming another one is refused."""
    _spec(schemas["ServiceSpec"], sorted(backends))
    _replica(schemas["ReplicaTemplate"])
    _route(schemas["RouteConfig"])
    _probe(schemas["ProbeConfig"])
    _rollout(schemas["RolloutStrategy"])
    _guards(schemas)
    _canary(schemas)
    _autoscaling(schemas["ServiceSpec"])


def _canary(schemas: dict[str, Schema]) -> None:
    """Preview and sticky settings (``PreviewConfig``, ``StickyConfig`` validators)."""
    preview = schemas["PreviewConfig"]["properties"]
    preview["header"]["pattern"] = HEADER_NAME
    preview["token_header"]["pattern"] = HEADER_NAME
    preview["tokens"]["items"]["pattern"] = "^[0-9a-f]{64}$"
    sticky = schemas["StickyConfig"]
    _string_option(sticky["properties"]["header"])["pattern"] = HEADER_NAME
    # A header or a cookie, one of the two (StickyConfig._one).
    sticky["oneOf"] = [
        {"required": ["header"], "properties": {"header": {"type": "string"}}},
        {"required": ["cookie"], "properties": {"cookie": {"type": "string"}}},
    ]


def _autoscaling(spec: Schema) -> None:
    """A count from 0 to MAX_REPLICAS (``ServiceSpec._replicas_count``); ``scaling`` only with
    a range of replicas (``ServiceSpec._scaling``). That a range's min is at most its max is
    the one rule JSON Schema cannot state (it compares no two fields): the description says
    it, and the API refuses such a range with 422."""
    count = next(o for o in spec["properties"]["replicas"]["anyOf"] if o.get("type") == "integer")
    count.update(minimum=0, maximum=MAX_REPLICAS)
    spec.setdefault("allOf", []).append(
        {
            "anyOf": [
                {"not": {"required": ["scaling"]}},
                {"properties": {"scaling": {"type": "null"}}},
                {
                    "required": ["replicas"],
                    "properties": {"replicas": {"type": "object"}},
                },
            ]
        }
    )


_HEADER_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}"
RATE_KEY = rf"^(ip|token|header:{_HEADER_TOKEN})$"
AFFINITY_KEY = rf"^(ip|header:{_HEADER_TOKEN}|cookie:[!#$%&'*+.^_`|~0-9A-Za-z-]{{1,128}})$"
RATE_PREFIX = r"^/[^?# \t\r\n]*$"


def _guards(schemas: dict[str, Schema]) -> None:
    """auth, rate_limits and load_balancing's hash form (``ServiceSpec._guards``)."""
    auth = schemas["AuthConfig"]["properties"]
    auth["header"]["pattern"] = HEADER_NAME
    _string_option(auth["tokens_file"])["pattern"] = "^/[^\\u0000]*$"
    rate = schemas["RateLimit"]["properties"]
    rate["path_prefix"]["pattern"] = RATE_PREFIX
    rate["key"]["pattern"] = RATE_KEY
    rate["key"]["description"] = "ip, header:NAME or token (the bearer token's id: needs auth)"
    balancing = schemas["Balancing"]
    _string_option(balancing["properties"]["key"])["pattern"] = AFFINITY_KEY
    # A key with hash and only with hash (Balancing._key).
    balancing["anyOf"] = [
        {
            "required": ["policy", "key"],
            "properties": {"policy": {"const": "hash"}, "key": {"type": "string"}},
        },
        {
            "properties": {
                "policy": {"enum": ["round_robin", "least_outstanding", "p2c"]},
                "key": {"type": "null"},
            }
        },
    ]
    spec = schemas["ServiceSpec"]
    props = spec["properties"]
    props["rate_limits"]["maxItems"] = MAX_RATE_LIMITS
    plain = next(o for o in props["load_balancing"]["anyOf"] if o.get("type") == "string")
    plain["enum"] = [p for p in plain["enum"] if p != "hash"]  # the hash form has a key
    props["load_balancing"]["description"] = "A policy's name, or {policy: hash, key} for affinity."
    # A rate limit keyed by token needs auth.
    # (A pattern, not "not": the fuzz's generator does not draw from "not".)
    no_token_key = {
        "items": {"properties": {"key": {"pattern": rf"^(ip|header:{_HEADER_TOKEN})$"}}}
    }
    spec.setdefault("allOf", []).append(
        {
            "anyOf": [
                {"properties": {"rate_limits": no_token_key}},
                {"required": ["auth"], "properties": {"auth": {"type": "object"}}},
            ]
        }
    )


def _string_option(node: Schema) -> Schema:
    """The ``{"type": "string"}`` branch of an optional string's ``anyOf``."""
    return next(o for o in node["anyOf"] if o.get("type") == "string")


def _spec(spec: Schema, backends: list[str]) -> None:
    props = spec["properties"]
    # Through the API, a spec without a name takes the path's.
    spec["required"] = [r for r in spec["required"] if r != "name"]
    props["name"]["description"] = "Required in a spec file; through the API, the path's name."
    props["probes"]["maxItems"] = 8
    backend = props["backend"]
    backend["enum"] = [b for b in backend["enum"] if b in backends]
    if backend["default"] not in backends:
        spec["required"] = [*spec.get("required", []), "backend"]
    rules = []
    # The docker backend's fields are refused for the others (ServiceSpec._backend).
    no_docker = {name: {"type": "null"} for name in DOCKER_FIELDS}
    if "process" in backends:
        # A command, no addresses, and a fixed port only for one replica (ServiceSpec._backend).
        rules.append(
            {
                "properties": {
                    "backend": {"const": "process"},
                    "replica": {
                        "required": ["commands"],
                        "properties": {
                            "commands": {"minItems": 1},
                            "addresses": {"maxItems": 0},
                            **no_docker,
                        },
                    },
                },
                "anyOf": [
                    {"properties": {"replica": {"properties": {"port": {"type": "null"}}}}},
                    {
                        "properties": {
                            "replicas": {
                                "anyOf": [
                                    {"type": "null"},
                                    {"type": "integer", "maximum": 1},
                                    {"type": "object", "properties": {"max": {"maximum": 1}}},
                                ]
                            }
                        }
                    },
                ],
            }
        )
    if "static" in backends:
        # Addresses, no command, and no more replicas than addresses.
        at_most = [
            {
                "properties": {
                    # A count: a range is not for a static service (ServiceSpec._scaling).
                    "replicas": {"type": "integer", "maximum": n},
                    "replica": {"properties": {"addresses": {"minItems": n}}},
                }
            }
            for n in range(1, MAX_REPLICAS + 1)
        ]
        rules.append(
            {
                "required": ["backend"],
                "properties": {
                    "backend": {"const": "static"},
                    "replica": {
                        "required": ["addresses"],
                        "properties": {
                            "addresses": {"minItems": 1},
                            "commands": {"maxItems": 0},
                            **no_docker,
                        },
                    },
                },
                "anyOf": [{"properties": {"replicas": {"type": "null"}}}, *at_most],
            }
        )
    if "docker" in backends:
        # An image; no addresses and no working directory.
        rules.append(
            {
                "required": ["backend"],
                "properties": {
                    "backend": {"const": "docker"},
                    "replica": {
                        "required": ["image"],
                        "properties": {
                            "image": {"type": "string"},
                            "addresses": {"maxItems": 0},
                            "working_dir": {"type": "null"},
                        },
                    },
                },
            }
        )
    spec["allOf"] = [{"anyOf": rules}] if rules else [False]


def _replica(replica: Schema) -> None:
    props = replica["properties"]
    commands = props["commands"]
    commands["maxItems"] = MAX_COMMANDS
    commands["items"] = {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_COMMAND_LENGTH,
        "pattern": NOT_BLANK,
    }
    env = props["env"]
    env["maxProperties"] = MAX_ENV
    env["propertyNames"] = {"pattern": ENV_NAME_PATTERN, "not": {"const": "PORT"}}
    env["additionalProperties"] = {"type": "string", "maxLength": MAX_ENV_VALUE, "pattern": NO_NUL}
    env["description"] = "Variables for the replica; PORT is the backend's to set."
    working_dir = props["working_dir"]
    _string_option(working_dir)["pattern"] = ABSOLUTE_PATH
    working_dir["description"] = (
        "An absolute path (a spec file's relative one is resolved against the file by the "
        "config loader and the CLI)."
    )
    props["addresses"]["items"] = {"type": "string", "pattern": ADDRESS}


def _route(route: Schema) -> None:
    props = route["properties"]
    props["hosts"]["items"] = {"type": "string", "pattern": HOST}
    _string_option(props["path_prefix"])["pattern"] = PATH_PREFIX
    has_prefix = {"required": ["path_prefix"], "properties": {"path_prefix": {"type": "string"}}}
    strips = {"required": ["strip_prefix"], "properties": {"strip_prefix": {"const": True}}}
    route["allOf"] = [
        # Hosts, a path prefix, or both; and strip_prefix only with a prefix.
        {"anyOf": [{"required": ["hosts"], "properties": {"hosts": {"minItems": 1}}}, has_prefix]},
        {"anyOf": [{"not": strips}, has_prefix]},
    ]


def _probe(probe: Schema) -> None:
    props = probe["properties"]
    props["path"]["pattern"] = PROBE_PATH
    props["headers"]["propertyNames"] = {"pattern": HEADER_NAME}
    props["headers"]["additionalProperties"] = {"type": "string", "pattern": HEADER_VALUE}
    for name in ("interval", "timeout"):  # ProbeConfig._positive
        for option in props[name]["anyOf"]:
            if option["type"] == "number":
                del option["minimum"]
                option["exclusiveMinimum"] = 0
            else:
                option["pattern"] = POSITIVE_DURATION


def _rollout(rollout: Schema) -> None:
    # max_surge and max_unavailable are not both 0 (max_surge defaults to 1, the other to 0).
    # Steps only for a canary, analysis only for canary or blue_green (RolloutStrategy).
    rollout["allOf"] = [
        {
            "anyOf": [
                {"not": {"required": ["max_surge"]}},
                {"properties": {"max_surge": {"minimum": 1}}},
                {
                    "required": ["max_unavailable"],
                    "properties": {"max_unavailable": {"minimum": 1}},
                },
            ]
        },
        {
            "anyOf": [
                {"not": {"required": ["steps"]}},
                {"properties": {"steps": {"maxItems": 0}}},
                {"required": ["strategy"], "properties": {"strategy": {"const": "canary"}}},
            ]
        },
        {
            "anyOf": [
                {"not": {"required": ["analysis"]}},
                {"properties": {"analysis": {"type": "null"}}},
                {
                    "required": ["strategy"],
                    "properties": {"strategy": {"enum": ["canary", "blue_green"]}},
                },
            ]
        },
    ]
