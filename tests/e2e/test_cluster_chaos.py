"""Issue 54's chaos suite, each fault once (``tests/e2e/chaos.py``): three etcd members, three
nodes of two workers, a Docker service over two engines and a process service, load through
every survivor. One cluster serves every fault of the module, one after another: each test
leaves it whole (every node, member and engine back, both services complete).

Each fault is injected in the middle of a rollout of both services; the rollout completes and
no request fails on the survivors, but for those in flight on a process that died as it died.
``bench/cluster.py --chaos`` measures the same rounds, repeated.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.e2e.chaos import FAULTS, Chaos
from tests.e2e.cluster_nodes import LEASE_TTL
from tests.e2e.test_docker_engines import (  # the module's second engine, a fixture here too
    Engine,
    second_engine,  # noqa: F401
)

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chaos(
    tmp_path_factory: pytest.TempPathFactory,
    second_engine: Engine,  # noqa: F811
) -> AsyncIterator[Chaos]:
    async with Chaos.started(tmp_path_factory.mktemp("chaos"), second_engine) as cluster:
        yield cluster


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_fault_mid_rollout_fails_no_request_on_the_survivors(
    chaos: Chaos, fault: str
) -> None:
    result = await chaos.round(fault)
    print(f"\n{result.line()}")
    assert not result.failed, result.line()
    assert not [n for n in result.notes if "answered" in n or "acted after" in n], result.line()
    if fault in ("leader_kill", "leader_pause"):
        assert result.new_leader is not None
        assert result.new_leader <= LEASE_TTL + 2.0, result.line()
    if fault == "worker_kill":  # only what that worker held may have failed
        assert len(result.in_flight) <= 12, result.line()
