"""Importing the gateway changes nothing in the process: no library is patched, no import is
refused, nothing goes on a path. Only an entry point (``gateway serve``, a worker's
``python -m gateway.workers``, the suite's ``conftest``) calls ``gateway.native.use()``,
which puts the compiled modules on the package's path.

Each case runs a fresh interpreter: this one has imported everything already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SEEN = r"""
import sys
import tomllib
def seen():
    import hashlib, ssl
    return {
        "sha256": id(hashlib.sha256),
        "sha256_is_openssls": hashlib.sha256
        is getattr(sys.modules.get("_hashlib"), "openssl_sha256", None),
        "SSLContext": id(ssl.SSLContext),
        "SSLContext_is_openssls": issubclass(ssl.SSLContext, sys.modules["_ssl"]._SSLContext),
        "loaded": {m: id(sys.modules.get(m)) for m in ("hashlib", "_hashlib", "ssl", "_ssl")},
        "path": list(sys.path),
        "meta_path": [id(f) for f in sys.meta_path],
        "path_hooks": [id(h) for h in sys.path_hooks],
    }
"""

BEFORE_AND_AFTER = (
    SEEN
    + r"""
import json
before = seen()
for name in sys.argv[1:]:
    __import__(name)
gateway = sys.modules["gateway"]
print(json.dumps({
    "before": before,
    "after": seen(),
    "gateway_path": list(gateway.__path__),
    "compiled": sorted(
        name for name, module in sys.modules.items()
        if name.startswith("gateway.")
        and not (getattr(module, "__file__", None) or ".py").endswith(".py")
    ),
}))
"""
)

FIRST = (
    SEEN
    + r"""
import json
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps(seen()))
"""
)

MODULES = ("gateway", "controller.planning.planner", "gateway.workers.worker")


def run(program: str, *modules: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GATEWAY_NATIVE", None)  # a build, if there is one, is not used unless asked for
    out = subprocess.run(
        [sys.executable, "-c", program, *modules],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("module", MODULES)
def test_importing_it_changes_nothing(module: str) -> None:
    seen = run(BEFORE_AND_AFTER, module)
    assert seen["after"] == seen["before"]
    assert seen["gateway_path"] == [str(ROOT / "gateway")]  # no compiled modules put first
    assert seen["compiled"] == []


def test_hashlib_and_ssl_imported_after_the_gateway_are_openssls_own() -> None:
    seen = run(FIRST, *MODULES)
    assert seen["sha256_is_openssls"] is True
    assert seen["SSLContext_is_openssls"] is True


PURE_AT_RUN_TIME = r"""
import builtins, importlib.util, json, os, sys, types
forbidden, found, root = json.loads(sys.argv[1]), {}, os.getcwd()

def forbidden_imports(module):
    # A module in a forbidden package may import its package's other modules (the Docker
    # backend's pure modules take the backends' protocol, controller.backends.base).
    mine = [f for f in forbidden if not module.startswith(f + ".")]
    # Every import statement of the gateway's own modules that ran while ``module`` was
    # imported, and imported a forbidden module (a library's own imports are its own).
    hits = []
    real = builtins.__import__

    def spy(name, globals=None, locals=None, fromlist=(), level=0):
        imported = real(name, globals, locals, fromlist, level)
        importer = (globals or {}).get("__name__", "")
        if importer.split(".")[0] in ("gateway", "controller"):
            whole = importlib.util.resolve_name("." * level + name, globals["__package__"])
            submodules = [f"{whole}.{n}" for n in fromlist or () if f"{whole}.{n}" in sys.modules]
            for module in (whole, *submodules):
                if any(module == f or module.startswith(f + ".") for f in mine):
                    hits.append(f"{importer} -> {module}")
        return imported

    # Its packages but the top one stand empty: importing it runs theirs ``__init__`` too,
    # which is not what it imports (gateway.proxy's brings the whole proxy).
    top, *packages = module.split(".")[:-1]
    for depth in range(1, len(packages) + 1):
        name = ".".join([top, *packages[:depth]])
        sys.modules[name] = stand_in = types.ModuleType(name)
        stand_in.__path__ = [os.path.join(root, *name.split("."))]
    builtins.__import__ = spy
    __import__(module)
    return sorted(set(hits))

for module in json.loads(sys.argv[2]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child imports the module alone
        os.close(read)
        os.write(write, json.dumps(forbidden_imports(module)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        found[module] = json.loads(answer.read() or '["(the child failed)"]')
    os.waitpid(pid, 0)
print(json.dumps(found))
"""


def test_the_pure_modules_load_no_io_module_at_run_time() -> None:
    """What the purity contract of ``lint-imports`` cannot see: the ``gateway`` package gives
    its names on first use (PEP 562), so ``from gateway import Duration`` imports
    ``gateway.config`` alone at run time, while its imports for type checkers name every
    module (the contract ignores those). Each pure module, imported alone in a fresh
    process, runs no import of a forbidden module in the gateway's own code. As in the
    contract, a library's imports are its own (pydantic's entry points bring ``socket``
    through ``email``), and so are the module's packages' ``__init__`` (``gateway.proxy``'s
    imports the whole proxy: its pure modules are pure, the package is not)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (pure,) = [c for c in contracts if c["name"] == "Pure modules import no I/O module"]
    assert pure["allow_indirect_imports"] is False
    found = run(
        PURE_AT_RUN_TIME, json.dumps(pure["forbidden_modules"]), json.dumps(pure["source_modules"])
    )
    assert found == {module: [] for module in pure["source_modules"]}
