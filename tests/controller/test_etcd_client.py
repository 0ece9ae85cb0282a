"""controller/etcd/client.py against a real three-member etcd cluster on loopback."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvloop

from controller.etcd import (
    Compacted,
    Compare,
    Delete,
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Get,
    LeaseNotFound,
    Put,
    WatchEvent,
)
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import eventually

_prefixes = itertools.count()


@pytest.fixture
def prefix() -> bytes:
    return f"/test/{next(_prefixes)}/".encode()


@pytest.fixture
async def client(cluster: EtcdCluster) -> AsyncIterator[EtcdClient]:
    c = EtcdClient(cluster.endpoints, timeout=2.0)
    yield c
    await c.close()


def restore(cluster: EtcdCluster) -> None:
    for i, member in enumerate(cluster.members):
        if member.alive:
            cluster.continue_member(i)
        else:
            cluster.start_member(i)
    cluster.wait_healthy()


async def test_put_get_delete(client: EtcdClient, prefix: bytes) -> None:
    r1 = await client.put(prefix + b"a", b"1")
    r2 = await client.put(prefix + b"b", b"\x00\xff binary")
    assert r2 > r1 > 0
    kvs, revision = await client.get(prefix + b"a")
    assert revision >= r2
    assert [(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version) for kv in kvs] == [
        (prefix + b"a", b"1", r1, r1, 1)
    ]
    assert (await client.get(prefix + b"missing"))[0] == []
    r3 = await client.put(prefix + b"a", b"2")
    kvs, _ = await client.get(prefix, prefix=True)
    assert [(kv.key, kv.value, kv.version, kv.mod_revision) for kv in kvs] == [
        (prefix + b"a", b"2", 2, r3),
        (prefix + b"b", b"\x00\xff binary", 1, r2),
    ]
    # An older revision of the store.
    old, _ = await client.get(prefix + b"a", revision=r1)
    assert old[0].value == b"1"
    r4 = await client.delete(prefix + b"a")
    assert r4 > r3
    assert [kv.key for kv in (await client.get(prefix, prefix=True))[0]] == [prefix + b"b"]
    await client.delete(prefix, prefix=True)
    assert (await client.get(prefix, prefix=True))[0] == []


async def test_get_pages_through_a_big_prefix_at_one_revision(
    cluster: EtcdCluster, prefix: bytes
) -> None:
    client = EtcdClient(cluster.endpoints, page_size=3)
    try:
        for i in range(10):
            await client.put(prefix + b"k%02d" % i, b"%d" % i)
        await client.put(prefix[:-1] + b"0", b"outside the prefix")
        before = client.requests
        kvs, revision = await client.get(prefix, prefix=True)
        assert [kv.value for kv in kvs] == [b"%d" % i for i in range(10)]
        assert client.requests - before == 4
        assert all(kv.mod_revision <= revision for kv in kvs)
    finally:
        await client.close()


async def test_txn_success_and_failure_branches(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"leader"
    absent = [Compare(key, "CREATE", "EQUAL", 0)]
    won = await client.txn(absent, [Put(key, b"n1"), Get(key)], [Get(key)])
    assert won.succeeded
    assert [[kv.value for kv in r] for r in won.ranges] == [[b"n1"]]
    assert won.ranges[0][0].create_revision == won.revision
    lost = await client.txn(absent, [Put(key, b"n2")], [Get(key), Get(prefix + b"none")])
    assert not lost.succeeded
    assert [[kv.value for kv in r] for r in lost.ranges] == [[b"n1"], []]
    # Every compare target and result.
    created = won.revision
    ok = await client.txn(
        [
            Compare(key, "CREATE", "EQUAL", created),
            Compare(key, "MOD", "LESS", created + 1),
            Compare(key, "VERSION", "GREATER", 0),
            Compare(key, "VALUE", "EQUAL", b"n1"),
            Compare(key, "VALUE", "NOT_EQUAL", b"n2"),
            Compare(key, "LEASE", "EQUAL", 0),
        ],
        [Delete(key), Put(prefix + b"x/1", b""), Put(prefix + b"x/2", b"")],
    )
    assert ok.succeeded
    assert ok.ranges == []
    assert (await client.get(key))[0] == []
    await client.txn([], [Delete(prefix + b"x/", prefix=True)])
    assert (await client.get(prefix + b"x/", prefix=True))[0] == []
    with pytest.raises(TypeError):
        await client.txn([Compare(key, "VALUE", "EQUAL", 1)], [])


async def test_leases(client: EtcdClient, prefix: bytes) -> None:
    lease = await client.grant(10)
    assert lease > 0
    await client.put(prefix + b"node", b"up", lease=lease)
    kvs, _ = await client.get(prefix + b"node")
    assert kvs[0].lease == lease
    assert 9 <= await client.keepalive(lease) <= 10
    held = await client.txn([Compare(prefix + b"node", "LEASE", "EQUAL", lease)], [])
    assert held.succeeded
    await client.revoke(lease)
    assert (await client.get(prefix + b"node"))[0] == []
    assert await client.keepalive(lease) == 0
    await client.revoke(lease)  # gone already: fine
    with pytest.raises(LeaseNotFound):
        await client.put(prefix + b"node", b"up", lease=lease)
    with pytest.raises(EtcdError):
        await client.put(prefix + b"node", b"up", lease=lease)


async def test_watch_sees_puts_and_deletes_in_order(client: EtcdClient, prefix: bytes) -> None:
    start = await client.put(prefix + b"a", b"1")
    await client.put(prefix + b"b", b"2")
    await client.delete(prefix + b"a")
    last = await client.put(prefix + b"b", b"3")
    await client.put(prefix[:-1] + b"1", b"outside")
    seen: list[WatchEvent] = []
    async for batch in client.watch(prefix, prefix=True, start_revision=start):
        seen.extend(batch)
        if seen[-1].kv.mod_revision >= last:
            break
    assert [(e.type, e.kv.key, e.kv.value) for e in seen] == [
        ("PUT", prefix + b"a", b"1"),
        ("PUT", prefix + b"b", b"2"),
        ("DELETE", prefix + b"a", b""),
        ("PUT", prefix + b"b", b"3"),
    ]
    assert seen[2].kv.mod_revision == start + 2
    assert [e.kv.mod_revision for e in seen] == sorted(e.kv.mod_revision for e in seen)


async def test_watch_from_now_sees_later_changes(client: EtcdClient, prefix: bytes) -> None:
    """A watch without a start revision sees the puts after it was created, never one before.
    Puts go on until the watch sees one: whichever came after its creation (counting etcd's
    watchers instead raced with an earlier test's watch still closing)."""
    old = await client.put(prefix + b"k", b"old")
    watch = client.watch(prefix + b"k")
    first = asyncio.ensure_future(anext(watch))
    made: dict[int, bytes] = {}
    counter = itertools.count()

    async def seen() -> bool:
        if not first.done():
            value = b"new-%d" % next(counter)
            made[await client.put(prefix + b"k", value)] = value
        return first.done()

    await eventually(seen, every=0.05, what="the watch seeing a put made after it")
    batch = first.result()
    assert batch, "an empty batch"
    for event in batch:
        assert event.type == "PUT"
        assert event.kv.mod_revision > old, "a put from before the watch"
        assert made.get(event.kv.mod_revision) == event.kv.value
    await watch.aclose()  # type: ignore[attr-defined]


async def test_watch_and_get_of_a_compacted_revision(client: EtcdClient, prefix: bytes) -> None:
    start = await client.put(prefix + b"k", b"1")
    last = await client.put(prefix + b"k", b"2")
    await client.compact(last)
    with pytest.raises(Compacted) as caught:
        async for _ in client.watch(prefix + b"k", start_revision=start):
            pass
    assert caught.value.revision == last
    with pytest.raises(Compacted):
        await client.get(prefix + b"k", revision=start)
    # From the compaction on, it works.
    async for batch in client.watch(prefix + b"k", start_revision=last):
        assert batch[0].kv.value == b"2"
        break


async def test_a_killed_member_changes_nothing(
    cluster: EtcdCluster, client: EtcdClient, prefix: bytes
) -> None:
    await client.put(prefix + b"k", b"1")
    current = cluster.endpoints.index(client.current)
    cluster.kill_member(current)
    try:
        started = time.monotonic()
        await client.put(prefix + b"k", b"2")
        assert (await client.get(prefix + b"k"))[0][0].value == b"2"
        assert client.current != cluster.endpoints[current]
        lease = await client.grant(5)
        assert await client.keepalive(lease) > 0
        assert time.monotonic() - started < client.timeout
    finally:
        restore(cluster)


async def test_a_paused_member_costs_half_the_timeout(
    cluster: EtcdCluster, client: EtcdClient, prefix: bytes
) -> None:
    await client.put(prefix + b"k", b"1")
    current = cluster.endpoints.index(client.current)
    cluster.pause_member(current)
    try:
        started = time.monotonic()
        assert (await client.get(prefix + b"k"))[0][0].value == b"1"
        assert time.monotonic() - started < client.timeout
        assert client.current != cluster.endpoints[current]
    finally:
        restore(cluster)


async def test_a_broken_watch_stream_raises_unavailable(
    cluster: EtcdCluster, client: EtcdClient, prefix: bytes
) -> None:
    revision = await client.put(prefix + b"k", b"1")
    watch = client.watch(prefix + b"k", start_revision=revision)
    assert (await anext(watch))[0].kv.value == b"1"  # the watch is open
    first = asyncio.ensure_future(anext(watch))
    cluster.kill_member(cluster.endpoints.index(client.current))
    try:
        with pytest.raises(EtcdUnavailable):
            await asyncio.wait_for(first, 5)
    finally:
        restore(cluster)


async def test_a_watch_on_a_paused_member_raises_unavailable(
    cluster: EtcdCluster, prefix: bytes
) -> None:
    client = EtcdClient(cluster.endpoints, timeout=1.0, watch_check=0.5)
    try:
        revision = await client.put(prefix + b"k", b"1")
        watch = client.watch(prefix + b"k", start_revision=revision)
        assert (await anext(watch))[0].kv.value == b"1"  # the watch is open
        first = asyncio.ensure_future(anext(watch))
        paused = cluster.endpoints.index(client.current)
        cluster.pause_member(paused)
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="stopped answering"):
            await asyncio.wait_for(first, 5)
        assert time.monotonic() - started < 0.5 + 1.0 + 0.5
        # Watching again goes to a member that answers.
        again = client.watch(prefix + b"k", start_revision=revision)
        batch = await asyncio.wait_for(anext(again), 5)
        assert batch[0].kv.mod_revision == revision
        await again.aclose()  # type: ignore[attr-defined]
    finally:
        restore(cluster)
        await client.close()


async def test_a_watch_ends_when_its_member_loses_the_leader(
    cluster: EtcdCluster, prefix: bytes
) -> None:
    client = EtcdClient(cluster.endpoints, timeout=1.0, watch_check=60)
    try:
        revision = await client.put(prefix + b"k", b"1")
        watch = client.watch(prefix + b"k", start_revision=revision)
        assert (await anext(watch))[0].kv.value == b"1"
        first = asyncio.ensure_future(anext(watch))
        kept = cluster.endpoints.index(client.current)
        for i in range(len(cluster.members)):
            if i != kept:
                cluster.kill_member(i)
        # Alone, the member loses its leader and ends the watch (gRPC metadata hasleader),
        # long before the watch would check it.
        with pytest.raises(EtcdUnavailable, match="no leader"):
            await asyncio.wait_for(first, 10)
    finally:
        restore(cluster)
        await client.close()


async def test_a_quiet_watch_stays_open(cluster: EtcdCluster, prefix: bytes) -> None:
    client = EtcdClient(cluster.endpoints, timeout=1.0, watch_check=0.2)
    try:
        watch = client.watch(prefix + b"k")
        pending = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(1.0)  # the quiet spell under test: five checks, all answered
        assert not pending.done()
        revision = await client.put(prefix + b"k", b"1")
        assert (await asyncio.wait_for(pending, 5))[0].kv.mod_revision == revision
        await watch.aclose()  # type: ignore[attr-defined]
    finally:
        await client.close()


async def test_all_members_stopped_then_back(
    cluster: EtcdCluster, client: EtcdClient, prefix: bytes
) -> None:
    await client.put(prefix + b"k", b"1")
    cluster.stop_all()
    try:
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable) as caught:
            await client.get(prefix + b"k")
        elapsed = time.monotonic() - started
        assert client.timeout - 0.1 <= elapsed < client.timeout + 0.5
        assert all(e in str(caught.value) for e in cluster.endpoints)
        assert set(caught.value.reasons) == set(cluster.endpoints)
        with pytest.raises(EtcdUnavailable):
            async for _ in client.watch(prefix + b"k"):
                pass
    finally:
        restore(cluster)
    assert (await client.get(prefix + b"k"))[0][0].value == b"1"
    assert await client.put(prefix + b"k", b"2") > 0


async def test_a_refused_request_is_an_error_not_unavailable(client: EtcdClient) -> None:
    with pytest.raises(EtcdError) as caught:
        await client.get(b"/k", revision=10**12)  # a future revision
    assert not isinstance(caught.value, Compacted)


def test_on_uvloop(cluster: EtcdCluster, tmp_path: Path) -> None:
    async def main() -> list[bytes]:
        client = EtcdClient(cluster.endpoints)
        try:
            start = await client.put(b"/uvloop/k", b"1")
            await client.put(b"/uvloop/k", b"2")
            async for batch in client.watch(b"/uvloop/k", start_revision=start):
                if len(batch) == 2:
                    return [e.kv.value for e in batch]
                return [e.kv.value for e in batch] + [b"?"]
            return []
        finally:
            await client.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) in ([b"1", b"2"], [b"1", b"?"])


async def test_authentication(tmp_path: Path) -> None:
    with EtcdCluster(tmp_path, 1) as single:
        endpoint = single.endpoints[0]
        for args in (["user", "add", "root:secret"], ["auth", "enable"]):
            subprocess.run(
                ["etcdctl", "--endpoints", endpoint, *args],
                check=True,
                capture_output=True,
                env={**os.environ, "ETCDCTL_API": "3"},
            )
        client = EtcdClient(single.endpoints, username="root", password="secret")
        anonymous = EtcdClient(single.endpoints)
        wrong = EtcdClient(single.endpoints, username="root", password="wrong")
        try:
            revision = await client.put(b"/auth/k", b"1")
            assert (await client.get(b"/auth/k"))[0][0].mod_revision == revision
            client._token = "stale.token"  # as after etcd restarted or the token expired
            assert (await client.get(b"/auth/k"))[0][0].value == b"1"
            async for batch in client.watch(b"/auth/k", start_revision=revision):
                assert batch[0].kv.value == b"1"
                break
            with pytest.raises(EtcdError):
                await anonymous.get(b"/auth/k")
            with pytest.raises(EtcdError, match="authentication failed"):
                await wrong.get(b"/auth/k")
        finally:
            for c in (client, anonymous, wrong):
                await c.close()
