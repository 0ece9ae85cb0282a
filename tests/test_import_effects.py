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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SEEN = r"""
import sys
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

MODULES = ("gateway", "controller.planner", "gateway.workers.worker")


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
