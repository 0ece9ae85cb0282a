"""The data plane's public names (gateway/__init__.py): each declared once, by its
``TYPE_CHECKING`` import, and imported on first use."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gateway

ROOT = Path(__file__).resolve().parents[2]


def test_each_public_name_is_the_object_of_the_module_that_declares_it():
    exports = gateway._exports()
    assert len(exports) > 50
    for name, where in exports.items():
        module = importlib.import_module(where, "gateway")
        assert getattr(gateway, name) is getattr(module, name), name
    assert gateway.__all__ == sorted(exports)
    assert set(exports) <= set(dir(gateway))


def test_star_import_gives_the_public_names_and_an_unknown_name_is_an_attribute_error():
    namespace: dict[str, object] = {}
    exec("from gateway import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(gateway.__all__)
    with pytest.raises(AttributeError, match="NoSuchName"):
        gateway.NoSuchName  # noqa: B018


def test_a_name_imports_only_its_own_module():
    # A fresh interpreter: this one has imported everything already.
    program = (
        "import sys, gateway; gateway.ProbeConfig; gateway.__all__;"
        "print(sorted(m for m in sys.modules if m.startswith(('gateway.', 'prometheus'))))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", program], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout)
    assert "gateway.config" in loaded
    assert not {
        "gateway.health.prober",
        "gateway.observability.scrape",
        "gateway.observability.metrics",
        "prometheus_client",
    } & set(loaded), loaded
