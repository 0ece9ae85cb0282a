"""What a test needs of the machine that Python does not bring: an engine or a server (a
Docker Engine, etcd, pebble, Prometheus) or the image bases ``.ci/docker.sh`` makes.

Without it the test is skipped, saying what is missing and how to get it (``-rs`` prints
why in the summary); under CI (``$CI`` set to ``true`` or ``1``, as ``.ci/run`` sets it,
which installs and starts all of it) a missing one is a failure, so that CI never passes by
skipping what it is there to test.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(why: str, *, module: bool = False) -> NoReturn:
    """Skip the test (its whole module, with ``module``) for ``why``; under CI, fail it."""
    if under_ci():
        pytest.fail(f"{why} (under CI a missing engine or tool is a failure)", pytrace=False)
    pytest.skip(why, allow_module_level=module)
