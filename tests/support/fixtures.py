"""Fixtures more than one test directory uses, registered for the whole suite by
``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trustme

from tests.support.etcd_cluster import EtcdCluster


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    """A certificate authority made for this test run; ``ca.issue_cert(name)`` signs one."""
    return trustme.CA()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One real etcd member for the module (skipped without etcd, failed under CI); each test
    keeps to a key prefix of its own. ``cluster`` (tests/controller) has three."""
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), 1) as member:
        yield member
