"""The request path's layout (gateway/proxy/__init__.py): the client side and the upstream
side never import each other; what both need is in ``streams``."""

from __future__ import annotations

import ast
from pathlib import Path

import gateway.proxy

PROXY = Path(gateway.proxy.__file__).parent
CLIENT_SIDE = {"http1_downstream", "request"}
UPSTREAM_SIDE = {"connector", "upstream_connection"}


def imported(module: str) -> set[str]:
    """The modules of gateway.proxy that ``module`` imports (every import, TYPE_CHECKING ones
    and those inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse((PROXY / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            out.update(n.split(".")[2] for n in names if n.startswith("gateway.proxy."))
    return out


def test_the_client_side_and_the_upstream_side_do_not_import_each_other():
    for module in CLIENT_SIDE:
        assert not imported(module) & UPSTREAM_SIDE, module
    for module in UPSTREAM_SIDE:
        assert not imported(module) & CLIENT_SIDE, module


def test_the_sides_are_what_the_package_has():
    modules = {p.stem for p in PROXY.glob("*.py")} - {"__init__"}
    assert CLIENT_SIDE | UPSTREAM_SIDE <= modules
    assert imported("upstream_connection") >= {"streams"}  # what it shares with the client side
