"""tests/needs.py: a missing engine skips a test, saying why, and fails it under CI."""

from __future__ import annotations

import pytest

from tests.needs import missing


@pytest.mark.parametrize("ci", ["", "false", "0"])
def test_outside_ci_a_missing_engine_skips_saying_why(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match=r"^etcd is not installed$"):
        missing("etcd is not installed")


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_under_ci_a_missing_engine_fails(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"^etcd is not installed \(under CI"):
        missing("etcd is not installed")
