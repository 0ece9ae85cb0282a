"""Every third-party module the gateway imports at run time comes with ``pip install .``.

``pip install .`` installs ``[project] dependencies`` and nothing else: a module that comes
only with the test tools (mypy brings ``mypy_extensions``) works in the dev venv and fails in
a user's. The imports are read from the sources (``ast``), those under ``TYPE_CHECKING``
left out; each is mapped to the distribution that provides it in this venv, which must be
a dependency or a dependency's own (``pydantic_core`` comes with pydantic).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "controller")


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> set[str]:
    """Top-level names of the modules ``tree`` imports, outside ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


@functools.cache
def third_party_imports() -> dict[str, list[str]]:
    """Third-party top-level module -> the source files that import it."""
    seen: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imports(ast.parse(path.read_text(), str(path))):
                if name in sys.stdlib_module_names or name in PACKAGES or name == "__future__":
                    continue
                seen.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return seen


def _names(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` name, but those of extras."""
    return {
        _normal(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0])
        for requirement in requirements
        if "extra ==" not in requirement
    }


def _requires(dist: str) -> set[str]:
    """What installing ``dist`` installs with it (its requirements outside extras)."""
    try:
        return _names(metadata.requires(dist) or [])
    except metadata.PackageNotFoundError:
        return set()


def installed_with_gateway() -> set[str]:
    """The distributions ``pip install .`` installs: the dependencies and theirs. The
    gateway's own are read from the sources' pyproject.toml, not from the venv's metadata of
    it (the last ``pip install``'s, which may be older than the sources)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        declared = tomllib.load(f)["project"]["dependencies"]
    found: set[str] = set()
    todo = _names(declared)
    while todo:
        dist = todo.pop()
        if dist not in found:
            found.add(dist)
            todo |= _requires(dist)
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_module_imported_at_run_time_comes_with_the_install():
    providers = metadata.packages_distributions()
    wanted = installed_with_gateway()
    missing = {}
    for module, files in third_party_imports().items():
        dists = {_normal(d) for d in providers.get(module, [])}
        if not dists & wanted:
            missing[module] = (sorted(dists), files[:3])
    assert not missing, f"imported at run time, not installed by `pip install .`: {missing}"


def test_the_scan_sees_what_it_checks():
    # The check is only as good as the scan: it finds the known imports, and none of those
    # under TYPE_CHECKING.
    imports = third_party_imports()
    for module in ("aiohttp", "uvloop", "httptools", "pydantic", "yaml", "acme"):
        assert module in imports
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hidden\n")
    assert "hidden" not in _imports(tree)
