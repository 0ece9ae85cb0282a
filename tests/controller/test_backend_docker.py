"""The Docker backend against a real Docker Engine, with containers published on loopback.

The engine is ``$GATEWAY_TEST_DOCKER_HOST`` (default ``unix:///var/run/docker.sock``), the image
``$GATEWAY_TEST_IMAGE`` (it must have ``sh`` and ``python3``). With no engine answering, the
tests are skipped, unless ``$CI`` is set: then they fail. Each test has its own instance id,
and every container with it is removed at teardown. Tests await exits (the exit handler) and
HTTP answers; none sleeps to let something happen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from controller.backends import Exit, Launch
from controller.backends.docker import (
    DockerBackend,
    DockerHost,
    EngineClient,
    HostState,
    NoRoom,
    SshOptions,
    place,
    ssh_command,
)
from controller.backends.docker.container import container_config
from controller.backends.docker.hosts import ReplicaRecord
from controller.backends.docker.placement import HostLoad, gpus_for
from controller.errors import NoCapacity, StartFailed
from controller.metrics import DockerHostMetrics
from controller.spec import ReplicaTemplate
from gateway import dump_settings
from tests.needs import missing
from tests.support.eventually import eventually
from tests.support.ports import free_port

ENGINE = os.environ.get("GATEWAY_TEST_DOCKER_HOST", "unix:///var/run/docker.sock")
IMAGE = os.environ.get("GATEWAY_TEST_IMAGE", "local/bookworm-python:test")
SERVER = "python3 -m http.server $PORT"
MISSING = "gateway-test/no-such-image:never"


async def engine_or_skip() -> None:
    """Skip (or fail under CI) when no engine answers or the test image is missing."""
    client = EngineClient(ENGINE)
    why = ""
    try:
        await client.ping()
        if not await client.image_exists(IMAGE):
            why = f"test image {IMAGE} missing on {ENGINE}"
    except Exception as exc:
        why = f"no Docker Engine at {ENGINE}: {exc}"
    finally:
        await client.close()
    if why:
        missing(why)


async def remove_labelled(instance: str) -> int:
    client = EngineClient(ENGINE)
    try:
        found = await client.containers({"gateway.instance": instance})
        for container in found:
            await client.remove(container["Id"])
        return len(found)
    finally:
        await client.close()


@dataclass
class Harness:
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    backends: list[DockerBackend] = field(default_factory=list)
    exits: dict[str, asyncio.Future[Exit]] = field(default_factory=dict)
    port_base: int = 23000

    def backend(
        self, hosts: list[DockerHost] | None = None, orphan_grace: float = 60.0
    ) -> DockerBackend:
        if hosts is None:
            hosts = [self.host("local", 4)]
        backend = DockerBackend(
            hosts, self.instance, stop_grace_default=1.0, orphan_grace=orphan_grace
        )
        backend.set_exit_handler(self._on_exit)
        self.backends.append(backend)
        return backend

    def host(self, name: str, capacity: int) -> DockerHost:
        # Per test and host, a block of ports of its own.
        low = self.port_base + (int(self.instance[:4], 16) % 200) * 10
        self.port_base += 2000
        return DockerHost(name, ENGINE, "127.0.0.1", capacity, (low, low + 9))

    def exit_of(self, replica_id: str) -> asyncio.Future[Exit]:
        return self.exits.setdefault(replica_id, asyncio.get_running_loop().create_future())

    def _on_exit(self, event: Exit) -> None:
        future = self.exit_of(event.replica_id)
        assert not future.done(), f"second exit of {event.replica_id}"
        future.set_result(event)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    await engine_or_skip()
    h = Harness()
    yield h
    for backend in h.backends:
        await backend.close()
    assert await remove_labelled(h.instance) == 0, "containers left behind"


def launch(rid: str, service: str = "web", image: str = IMAGE, **template: object) -> Launch:
    spec = {"image": image, "commands": [SERVER], **template}
    return Launch(service, 1, rid, ReplicaTemplate.model_validate(spec))


async def answer(host: str, port: int, timeout: float = 10.0) -> str:
    """The status of the replica's answer to GET /, once it listens."""
    async with aiohttp.ClientSession() as session:

        async def get() -> str:
            async with session.get(f"http://{host}:{port}/") as response:
                return f"{response.status}"

        return await eventually(get, timeout=timeout, every=0.05, what=f"{host}:{port} listening")


async def test_start_serves_on_loopback_then_stop_reports_and_removes(harness: Harness) -> None:
    backend = harness.backend()
    running = await backend.start(launch("r1", env={"GREETING": "hi"}))
    assert (running.host, running.handle["host"]) == ("127.0.0.1", "local")
    assert await answer(running.host, running.port) == "200"
    assert backend.in_use == 1
    client = EngineClient(ENGINE)
    try:
        info = await client.inspect(running.handle["container"])
        assert info is not None
        labels = info["Config"]["Labels"]
        assert labels["gateway.instance"] == harness.instance
        assert (labels["gateway.service"], labels["gateway.replica"]) == ("web", "r1")
        assert "GREETING=hi" in info["Config"]["Env"]
        assert "PORT=8000" in info["Config"]["Env"]
        bindings = info["HostConfig"]["PortBindings"]["8000/tcp"]
        assert bindings == [{"HostIp": "127.0.0.1", "HostPort": str(running.port)}]
        await backend.stop("r1", 1.0)
        end = harness.exit_of("r1").result()
        assert end.requested
        assert end.reason.startswith("stopped")
        assert await client.inspect(running.handle["container"]) is None
    finally:
        await client.close()
    assert backend.in_use == 0
    assert any("GET / HTTP" in line for line in backend.logs("r1", 50))


async def test_exit_is_seen_through_events_with_its_last_line(harness: Harness) -> None:
    backend = harness.backend()
    await backend.start(launch("crash", commands=["echo fatal: model missing >&2; exit 3"]))
    end = await asyncio.wait_for(harness.exit_of("crash"), 10)
    assert (end.code, end.requested) == (3, False)
    assert end.reason == "exited with code 3: fatal: model missing"
    assert backend.in_use == 0
    assert backend.logs("crash", 5) == ["fatal: model missing"]


async def test_logs_of_a_running_container_come_from_the_engine(harness: Harness) -> None:
    backend = harness.backend()
    await backend.start(launch("talk", commands=["echo one; echo two", SERVER]))
    # The admin API calls logs() off the loop, as here.
    await eventually(
        lambda: asyncio.to_thread(lambda: backend.logs("talk", 10)[:2] == ["one", "two"]),
        what="the container's first two lines",
    )
    await backend.stop("talk", 1.0)


async def test_adopt_after_a_new_backend_instance(harness: Harness) -> None:
    hosts = [harness.host("local", 4)]
    first = harness.backend(hosts)
    running = await first.start(launch("keep"))
    gone = await first.start(launch("gone"))
    await first.close()  # leaves both running, as a gateway restart does
    client = EngineClient(ENGINE)
    try:
        await client.stop(gone.handle["container"], 1)  # ended while no gateway watched
    finally:
        await client.close()
    second = harness.backend(hosts)
    await second.connect()
    handle = json.loads(json.dumps(running.handle))  # as the store keeps it
    adopted = second.adopt(launch("keep"), handle)
    assert adopted is not None
    assert (adopted.host, adopted.port) == (running.host, running.port)
    assert second.adopt(launch("gone"), gone.handle) is None
    assert second.adopt(launch("other"), handle) is None  # the container is another replica's
    assert second.in_use == 1
    assert await answer(adopted.host, adopted.port) == "200"
    # The adopted container's exit is seen by the new instance.
    client = EngineClient(ENGINE)
    try:
        await client.stop(running.handle["container"], 1)
    finally:
        await client.close()
    end = await asyncio.wait_for(harness.exit_of("keep"), 10)
    assert not end.requested
    await second.close()  # the exit is reported first; close lets its container's removal end
    assert await remove_labelled(harness.instance) == 1  # "gone", never adopted


async def running_ids(labels: dict[str, str]) -> set[str]:
    client = EngineClient(ENGINE)
    try:
        found = await client.containers(labels)
    finally:
        await client.close()
    return {c["Id"] for c in found if c.get("State") == "running"}


async def test_an_orphan_is_removed_after_the_grace_an_adopted_or_foreign_one_is_not(
    harness: Harness,
) -> None:
    hosts = [harness.host("local", 4)]
    first = harness.backend(hosts)
    kept = await first.start(launch("kept"))
    await first.close()
    low = hosts[0].port_range[0]
    foreign = uuid.uuid4().hex
    client = EngineClient(ENGINE)
    try:
        # Started, never recorded: the crash window. And another gateway's container.
        created = {}
        for name, instance in (("orphan", harness.instance), ("foreign", foreign)):
            labels = {"gateway.instance": instance, "gateway.host": "local"}
            config = container_config(launch(name), "127.0.0.1", low + 8, labels)
            config["HostConfig"].pop("PortBindings")
            created[name] = await client.create(f"gateway-test-{instance[:8]}-{name}", config)
            await client.start(created[name])
        second = harness.backend(hosts, orphan_grace=0.5)
        await second.connect()
        assert second.adopt(launch("kept"), kept.handle) is not None
        mine = {"gateway.instance": harness.instance}
        assert await running_ids(mine) == {kept.handle["container"], created["orphan"]}

        async def orphan_removed() -> bool:
            return created["orphan"] not in {c["Id"] for c in await client.containers(mine)}

        await eventually(orphan_removed, timeout=15, every=0.1, what="the orphan removed")
        assert await running_ids(mine) == {kept.handle["container"]}
        assert await running_ids({"gateway.instance": foreign}) == {created["foreign"]}
        assert not harness.exit_of("kept").done()
        await second.stop("kept", 1.0)
    finally:
        await client.close()
        await remove_labelled(foreign)


@pytest.mark.parametrize("pull", ["never", "if_not_present"])
async def test_missing_image_fails_the_start_with_the_reason(harness: Harness, pull: str) -> None:
    backend = harness.backend()
    with pytest.raises(StartFailed, match=rf"^image not found: {MISSING}"):
        await backend.start(launch("nope", image=MISSING, pull=pull))
    assert backend.in_use == 0


async def test_capacity_full_names_the_hosts(harness: Harness) -> None:
    backend = harness.backend([harness.host("a", 2), harness.host("b", 1)])
    for rid in ("r1", "r2", "r3"):
        await backend.start(launch(rid))
    with pytest.raises(NoCapacity) as caught:
        await backend.start(launch("r4"))
    assert caught.value.message == "no capacity: 2 of 2 hosts full (a: 2 of 2, b: 1 of 1)"
    await asyncio.gather(*(backend.stop(rid, 1.0) for rid in ("r1", "r2", "r3")))
    assert backend.in_use == 0


async def test_a_replica_asking_for_gpus_has_no_room_on_hosts_without(harness: Harness) -> None:
    backend = harness.backend([harness.host("a", 2), harness.host("b", 2)])
    with pytest.raises(NoCapacity) as caught:
        await backend.start(launch("g1", gpus=1))
    assert caught.value.message == (
        "no capacity: 2 of 2 hosts full or short of GPUs "
        "(a: 0 of 0 GPUs free, 1 needed, b: 0 of 0 GPUs free, 1 needed)"
    )
    assert backend.in_use == 0


async def fetch(host: str, port: int, path: str, timeout: float = 10.0) -> str:
    """The replica's body for GET ``path``, once it listens."""
    async with aiohttp.ClientSession() as session:

        async def get() -> str:
            async with session.get(f"http://{host}:{port}{path}") as response:
                return await response.text()

        return await eventually(get, timeout=timeout, every=0.05, what=f"{host}:{port} listening")


async def test_volumes_a_named_one_outlives_its_replica_a_host_path_read_only(
    harness: Harness, tmp_path: Path
) -> None:
    volume = f"gateway-test-{harness.instance[:12]}"
    backend = harness.backend()
    try:
        writer = launch(
            "w1",
            commands=["echo -n kept > /data/index.html", "python3 -m http.server $PORT -d /data"],
            volumes=[f"{volume}:/data"],
        )
        first = await backend.start(writer)
        assert await fetch(first.host, first.port, "/index.html") == "kept"
        await backend.stop("w1", 1.0)
        # A new container of the same volume reads what the first one wrote; read only, it
        # cannot write there (the ``!`` ends the container if it could).
        reader = launch(
            "r1",
            commands=["! touch /data/x 2>/dev/null", "python3 -m http.server $PORT -d /data"],
            volumes=[f"{volume}:/data:ro", f"{tmp_path}:/site:ro"],
        )
        (tmp_path / "page.txt").write_text("from the host")
        second = await backend.start(reader)
        assert await fetch(second.host, second.port, "/index.html") == "kept"
        client = EngineClient(ENGINE)
        try:
            info = await client.inspect(second.handle["container"])
        finally:
            await client.close()
        assert info is not None
        mounts = {m["Destination"]: (m["Type"], m["RW"]) for m in info["Mounts"]}
        assert mounts == {"/data": ("volume", False), "/site": ("bind", False)}
        await backend.stop("r1", 1.0)
        assert not harness.exit_of("r1").result().reason.startswith("exited")
    finally:
        socket_path = ENGINE.removeprefix("unix://")
        connector = aiohttp.UnixConnector(path=socket_path)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.delete(f"http://docker/v1.41/volumes/{volume}") as response:
                assert response.status in (204, 404), await response.text()


async def test_two_hosts_spread_a_service(harness: Harness) -> None:
    backend = harness.backend([harness.host("a", 4), harness.host("b", 4)])
    one = await backend.start(launch("s1"))
    two = await backend.start(launch("s2"))
    other = await backend.start(launch("o1", service="api"))
    assert {one.handle["host"], two.handle["host"]} == {"a", "b"}
    assert other.handle["host"] == "a"  # first listed among equals
    assert await answer(two.host, two.port) == "200"
    await asyncio.gather(*(backend.stop(rid, 1.0) for rid in ("s1", "s2", "o1")))


async def test_an_unreachable_engine_is_skipped(harness: Harness, tmp_path: object) -> None:
    down = DockerHost("down", f"unix://{tmp_path}/no.sock", "127.0.0.1", 4, (23990, 23999))
    backend = harness.backend([down, harness.host("up", 1)])
    running = await backend.start(launch("u1"))
    assert running.handle["host"] == "up"
    with pytest.raises(NoCapacity, match=r"down: unreachable, up: 1 of 1"):
        await backend.start(launch("u2"))
    await backend.stop("u1", 1.0)


def test_placement_spreads_then_takes_the_most_room() -> None:
    def load(
        name: str, cap: int, used: int, mine: int = 0, up: bool = True, rev: int = 0
    ) -> HostLoad:
        return HostLoad(name, cap, used, up, mine, rev)

    assert place([load("a", 4, 1, mine=1), load("b", 2, 1)]) == "b"
    assert place([load("a", 4, 1), load("b", 4, 0)]) == "b"
    # A rollout: the new revision spreads, whatever the old one holds.
    assert place([load("a", 2, 1, mine=1, rev=1), load("b", 2, 1, mine=1)]) == "b"
    assert place([load("a", 4, 0, up=False), load("b", 1, 0)]) == "b"
    none = place([load("a", 1, 1), load("b", 1, 0, up=False)])
    assert not isinstance(none, str)
    assert (
        none.reason == "no capacity: 1 of 2 hosts full, 1 unreachable (a: 1 of 1, b: unreachable)"
    )


def test_in_a_cluster_an_unreachable_host_is_named_with_the_node_that_reaches_for_it() -> None:
    """The leader alone talks to the engines: "unreachable" is as seen from that node."""
    hosts = [HostLoad("a", 2, 2, True, 2), HostLoad("b", 2, 1, False, 1)]
    none = place(hosts, "n2")
    assert isinstance(none, NoRoom)
    assert none.reason == (
        "no capacity: 1 of 2 hosts full, 1 unreachable (a: 2 of 2, b: unreachable from n2)"
    )
    alone = place(hosts)  # a gateway of its own names no node
    assert isinstance(alone, NoRoom)
    assert alone.reason.endswith("(a: 2 of 2, b: unreachable)")


async def test_the_backend_of_a_cluster_node_names_it_in_the_reason(tmp_path: Path) -> None:
    hosts = [DockerHost(name, f"unix://{tmp_path}/{name}.sock") for name in ("a", "b")]
    backend = DockerBackend(hosts, "instance", node="n2")
    try:
        with pytest.raises(NoCapacity) as caught:
            await backend.start(launch("r1"))
    finally:
        await backend.close()
    assert caught.value.message == (
        "no capacity: 0 of 2 hosts full, 2 unreachable "
        "(a: unreachable from n2, b: unreachable from n2)"
    )


def test_placement_counts_gpus_and_says_when_they_are_short() -> None:
    def load(name: str, used: int, gpus: int, gpus_used: int, needed: int) -> HostLoad:
        return HostLoad(name, 4, used, True, 0, 0, gpus, gpus_used, needed)

    # 2 GPUs needed: only where 2 are free, even with fewer replicas elsewhere.
    assert place([load("a", 0, 2, 1, 2), load("b", 3, 4, 2, 2)]) == "b"
    assert place([load("a", 0, 0, 0, 0), load("b", 1, 4, 0, 0)]) == "a"  # none asked for
    none = place([load("a", 4, 2, 0, 2), load("b", 1, 4, 3, 2), load("c", 0, 0, 0, 1)])
    assert isinstance(none, NoRoom)
    assert none.reason == (
        "no capacity: 3 of 3 hosts full or short of GPUs "
        "(a: 4 of 4, b: 1 of 4 GPUs free, 2 needed, c: 0 of 0 GPUs free, 1 needed)"
    )


async def test_the_backend_places_by_free_gpus(tmp_path: object) -> None:
    """Placement as the backend sees it (no engine needed: the load, not a start)."""
    hosts = [DockerHost("a", "unix:///nowhere", gpus=1), DockerHost("b", "unix:///nowhere", gpus=4)]
    backend = DockerBackend(hosts, "instance")
    try:
        loads = [backend._load(h, launch("r1", gpus=2)) for h in backend._hosts.values()]
        assert [(h.gpus, h.gpus_needed) for h in loads] == [(1, 2), (4, 2)]
        every = [backend._load(h, launch("r1", gpus="all")) for h in backend._hosts.values()]
        assert [h.gpus_needed for h in every] == [1, 4]
        ids = [
            backend._load(h, launch("r1", gpus=["0", "1", "2"])) for h in backend._hosts.values()
        ]
        assert [h.gpus_needed for h in ids] == [3, 3]
        plain = [backend._load(h, launch("r1")) for h in backend._hosts.values()]
        assert [h.gpus_needed for h in plain] == [0, 0]
    finally:
        await backend.close()


def test_gpus_are_given_by_device_id() -> None:
    free = ("0", "2", "3")
    assert gpus_for(free, 2) == ("0", "2")  # a count: the lowest free, in the host's order
    assert gpus_for(free, 4) is None
    assert gpus_for(free, 2, ("3", "2")) == ("3", "2")  # named devices: exactly those
    assert gpus_for(free, 2, ("1", "2")) is None  # 1 is held
    assert gpus_for((), 1) is None


def test_placement_by_device_ids_says_which_are_not_free() -> None:
    def load(name: str, free: tuple[str, ...], asked: tuple[str, ...] = ()) -> HostLoad:
        needed = len(asked) or 1
        return HostLoad(name, 4, 4 - len(free), True, 0, 0, 4, 4 - len(free), needed, free, asked)

    # The count says 2 free on each; only b has device 1 free.
    assert place([load("a", ("0", "3"), ("1",)), load("b", ("1", "2"), ("1",))]) == "b"
    none = place([load("a", ("0", "3"), ("1", "3")), load("b", (), ("1",))])
    assert isinstance(none, NoRoom)
    assert none.reason == (
        "no capacity: 2 of 2 hosts full or short of GPUs (a: GPU 1 not free, b: 4 of 4)"
    )


async def test_the_backend_holds_gpus_per_device_until_the_exit() -> None:
    """Each replica holds device ids, given to its container (DeviceIDs, label gateway.gpus)
    and read back at adoption; its exit frees them."""
    host = DockerHost("a", "unix:///nowhere", gpus=4)
    backend = DockerBackend([host], "instance")
    record = backend._hosts["a"]
    loop = asyncio.get_running_loop()

    def hold(rid: str, **template: object) -> ReplicaRecord:
        replica = ReplicaRecord(launch(rid, **template), record, 0, loop.create_future())
        replica.gpus = backend._gpus(record, replica.launch)
        record.replicas[rid] = replica
        return replica

    try:
        assert hold("r1", gpus=2).gpus == ("0", "1")
        assert hold("r2", gpus=["3"]).gpus == ("3",)
        assert hold("r3", gpus=1).gpus == ("2",)
        full = backend._load(record, launch("r4", gpus=1))
        assert full.gpus_short
        assert full.gpus_in_use == 4
        assert backend._load(record, launch("r4", gpus="all")).gpus_short
        del record.replicas["r1"]  # its exit reported: devices 0 and 1 free again
        assert backend._gpus(record, launch("r4", gpus=["1"])) == ("1",)
        config = container_config(launch("r4", gpus=2), "127.0.0.1", 21000, {}, ("0", "1"))
        assert config["HostConfig"]["DeviceRequests"] == [
            {"Driver": "nvidia", "Capabilities": [["gpu"]], "DeviceIDs": ["0", "1"]}
        ]
        assert config["Labels"]["gateway.gpus"] == "0,1"
        # Adoption reads the devices back from the container's label.
        labels = {"gateway.replica": "r5", "gateway.gpus": "0,1"}
        record.listing = {"c5": {"State": "running", "Labels": labels}}
        adopted = backend.adopt(launch("r5", gpus=2), {"host": "a", "container": "c5", "port": 1})
        assert adopted is not None
        assert adopted.handle["gpus"] == ["0", "1"]
        assert record.replicas["r5"].gpus == ("0", "1")
        assert backend._free_gpus(record) == ()  # r2: 3, r3: 2, r5: 0 and 1
    finally:
        record.replicas.clear()
        await backend.close()


# -- the spec: what the docker backend takes, and what the others refuse ----------------------

DOCKER_SPEC: dict[str, object] = {
    "name": "web",
    "backend": "docker",
    "route": {"path_prefix": "/"},
    "replicas": 3,
    "replica": {
        "image": "registry.example/web:1.2",
        "commands": [SERVER],
        "port": 8080,
        "resources": {"cpus": 0.5, "memory": "512m"},
        "user": "1000:1000",
        "pull": "always",
        "gpus": 2,
        "volumes": ["models:/models:ro", "/srv/cache:/cache"],
    },
}


def test_a_docker_spec_and_what_the_other_backends_refuse() -> None:
    from controller.config import ConfigError, parse_spec

    spec = parse_spec(DOCKER_SPEC, "t")
    resources = spec.replica.resources
    assert resources is not None
    assert resources.memory_bytes == 512 * 1024 * 1024
    assert spec.desired_replicas == 3  # a fixed container port allows many replicas
    process = {**DOCKER_SPEC, "backend": "process", "replicas": 1}
    cases = [
        (process, "replica.image: only for the docker backend"),
        (
            {**DOCKER_SPEC, "replica": {"commands": [SERVER]}},
            "replica.image: the docker backend needs an image",
        ),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "working_dir": "/srv"}},
            "replica.working_dir: not for the docker backend",
        ),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "resources": {"memory": "lots"}}},
            "replica.resources.memory",
        ),
        (
            {**process, "replica": {"commands": [SERVER], "gpus": 1}},
            "replica.gpus: only for the docker backend",
        ),
        (
            {**process, "replica": {"commands": [SERVER], "volumes": ["d:/d"]}},
            "replica.volumes: only for the docker backend",
        ),
        ({**DOCKER_SPEC, "replica": {"image": "x", "gpus": 0}}, "replica.gpus: a count from 1"),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "gpus": "some"}},
            "replica.gpus: a count, 'all', or a list of device ids",
        ),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "gpus": ["0", "0"]}},
            "replica.gpus: a device id is listed twice",
        ),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "gpus": ["0", "a b"]}},
            "replica.gpus: not a device id: 'a b'",
        ),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "volumes": ["data:srv"]}},
            "replica.volumes: 'data:srv': the container path must be absolute",
        ),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "volumes": ["/h:/srv:rx"]}},
            "replica.volumes: '/h:/srv:rx': the mode is ro or rw, not 'rx'",
        ),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "volumes": ["./h:/srv"]}},
            "replica.volumes: './h:/srv': the source is a volume name",
        ),
        (
            {**DOCKER_SPEC, "replica": {"image": "x", "volumes": ["/srv"]}},
            "replica.volumes: '/srv': SOURCE:/PATH or SOURCE:/PATH:ro|rw",
        ),
    ]
    for data, reason in cases:
        with pytest.raises(ConfigError, match=re.escape(reason)):
            parse_spec(data, "t")


def test_unset_docker_fields_leave_a_revision_key_as_it_was() -> None:
    import hashlib

    from controller.spec import ServiceSpec

    spec = ServiceSpec.model_validate(
        {"name": "web", "route": {"path_prefix": "/"}, "replica": {"commands": ["run"]}}
    )
    replica: dict[str, object] = {
        "commands": ["run"],
        "env": {},
        "working_dir": None,
        "port": None,
        "addresses": [],
    }
    # A probe as it was before gRPC probes (no ``service``).
    probes = [
        {k: v for k, v in dump_settings(p).items() if k != "service"} for p in spec.effective_probes
    ]
    doc = {"backend": "process", "replica": replica, "probes": probes}
    before = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    assert spec.template_key() == before


def test_the_api_document_states_the_docker_rules() -> None:
    from controller.admin.handlers import OPERATIONS_TABLE
    from controller.admin.openapi import build_document
    from tests.controller.test_openapi import SchemaError, Validator

    service = {"$ref": "#/components/schemas/ServiceSpec"}
    with_docker = Validator(build_document(OPERATIONS_TABLE, ("process", "static", "docker")))
    with_docker.validate(service, DOCKER_SPEC)
    process = {**DOCKER_SPEC, "backend": "process", "replicas": 1}
    replica = DOCKER_SPEC["replica"]
    assert isinstance(replica, dict)
    for bad in (
        process,
        {**DOCKER_SPEC, "replica": {"commands": [SERVER]}},
        {**DOCKER_SPEC, "replica": {**replica, "gpus": ["0", "0"]}},
        {**DOCKER_SPEC, "replica": {**replica, "gpus": 0}},
        {**DOCKER_SPEC, "replica": {**replica, "volumes": ["data:srv"]}},
        {**DOCKER_SPEC, "replica": {**replica, "volumes": ["/h:/srv:rx"]}},
    ):
        with pytest.raises(SchemaError):
            with_docker.validate(service, bad)
    without = Validator(build_document(OPERATIONS_TABLE, ("process", "static")))
    with pytest.raises(SchemaError):
        without.validate(service, DOCKER_SPEC)


class SocketProxy:
    """A unix socket in front of the engine's, that a test can cut (the engine went away: every
    connection closed, the socket gone) and open again."""

    def __init__(self, path: str, target: str) -> None:
        self.path, self.target = path, target
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def open(self) -> None:
        self.server = await asyncio.start_unix_server(self._client, path=self.path)

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        os.unlink(self.path)
        for writer in self.writers:
            writer.close()
        self.writers.clear()

    async def close(self) -> None:
        if self.server is not None and self.server.is_serving():
            await self.cut()
        if self.server is not None:
            await self.server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(self.target)
        self.writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_an_engine_that_goes_away_stops_nothing_and_missed_exits_are_seen_after(
    harness: Harness, tmp_path: object
) -> None:
    if not ENGINE.startswith("unix://"):
        pytest.skip("the proxy fronts a unix socket engine")
    proxy = SocketProxy(f"{tmp_path}/engine.sock", ENGINE.removeprefix("unix://"))
    await proxy.open()
    try:
        await went_away(harness, proxy)
    finally:
        await proxy.close()


async def went_away(harness: Harness, proxy: SocketProxy) -> None:
    host = dataclasses.replace(harness.host("h", 2), engine=f"unix://{proxy.path}")
    backend = harness.backend([host])
    heard: list[HostState] = []
    backend.host_listeners.append(heard.append)
    registry = CollectorRegistry()
    registry.register(DockerHostMetrics([backend]))
    running = await backend.start(launch("r1"))
    assert registry.get_sample_value("gateway_docker_host_up", {"host": "h"}) == 1
    assert heard == []  # the first answer is no change
    await proxy.cut()
    await eventually(lambda: "unreachable" in repr(backend))
    assert registry.get_sample_value("gateway_docker_host_up", {"host": "h"}) == 0
    assert [(s.name, s.reachable, s.replicas) for s in heard] == [("h", False, 1)]
    assert heard[0].error.startswith(f"engine unix://{proxy.path}")
    # The replica serves on; the backend neither reports nor stops anything.
    assert await answer(running.host, running.port) == "200"
    assert not harness.exit_of("r1").done()
    with pytest.raises(NoCapacity, match=r"h: unreachable"):
        await backend.start(launch("r2"))
    # It ends while the engine is out of sight: the exit is reported once it answers again.
    client = EngineClient(ENGINE)
    try:
        await client.stop(running.handle["container"], 1)
    finally:
        await client.close()
    await proxy.open()
    end = await asyncio.wait_for(harness.exit_of("r1"), 15)
    assert [s.reachable for s in heard] == [False, True]
    assert registry.get_sample_value("gateway_docker_host_up", {"host": "h"}) == 1
    assert not end.requested
    assert end.code == -15
    assert end.reason.startswith("killed by signal 15 (SIGTERM)")
    assert backend.in_use == 0
    await backend.close()  # the exit is reported first: the removal ends before the proxy goes


async def test_a_stop_its_engine_cannot_answer_is_an_exit_at_once_the_slot_held_till_it_can(
    harness: Harness, tmp_path: object
) -> None:
    """A replica given up on a host cut off (its engine unreachable) is reported stopped at
    once, so that the controller replaces it elsewhere; it keeps its slot on the host, and its
    container is stopped and removed once the engine answers, with no second exit."""
    if not ENGINE.startswith("unix://"):
        pytest.skip("the proxy fronts a unix socket engine")
    proxy = SocketProxy(f"{tmp_path}/engine.sock", ENGINE.removeprefix("unix://"))
    await proxy.open()
    try:
        host = dataclasses.replace(harness.host("h", 1), engine=f"unix://{proxy.path}")
        backend = harness.backend([host])
        exits: list[Exit] = []
        backend.set_exit_handler(exits.append)
        changed = asyncio.Event()
        heard: list[HostState] = []

        def hear(state: HostState) -> None:
            heard.append(state)
            changed.set()

        backend.host_listeners.append(hear)
        running = await backend.start(launch("r1"))
        await proxy.cut()
        await eventually(lambda: heard, changed=changed.wait, what="host h unreachable")
        changed.clear()
        assert not heard[-1].reachable

        await asyncio.wait_for(backend.stop("r1", 1.0), 5)
        assert [(e.replica_id, e.code, e.requested) for e in exits] == [("r1", None, True)]
        assert exits[0].reason.startswith("stopped while host h is unreachable (engine unix://")
        assert exits[0].reason.endswith(
            ": its container is stopped and removed once the engine answers"
        )
        assert backend.in_use == 1  # its slot, port and GPUs are held
        with pytest.raises(NoCapacity, match=r"h: unreachable"):
            await backend.start(launch("r2"))
        assert await answer(running.host, running.port) == "200"  # nothing reached it
        await asyncio.wait_for(backend.stop("r1", 1.0), 5)  # asked again: nothing more

        await proxy.open()
        await eventually(lambda: heard[-1].reachable, changed=changed.wait, what="h answers")
        await eventually(lambda: backend.in_use == 0, timeout=15, what="r1 stopped and removed")
        assert await running_ids({"gateway.instance": harness.instance}) == set()
        assert len(exits) == 1
        await backend.close()
    finally:
        await proxy.close()


# -- container.py: the create body and the exit reason (pure) --------------------------------


def test_the_create_body_of_a_launch() -> None:
    from controller.backends.docker.container import container_config, container_name

    body = container_config(
        Launch("web", 2, "web-2-abc", ReplicaTemplate.model_validate(DOCKER_SPEC["replica"])),
        "10.0.0.5",
        21007,
        {"gateway.instance": "i", "gateway.host": "a"},
    )
    assert body["Image"] == "registry.example/web:1.2"
    assert body["Entrypoint"] == ["/bin/sh", "-c"]
    assert body["Cmd"] == ["{ exec python3 -m http.server $PORT\n}"]
    assert "PORT=8080" in body["Env"]
    assert body["Labels"] == {
        "gateway.instance": "i",
        "gateway.host": "a",
        "gateway.service": "web",
        "gateway.revision": "2",
        "gateway.replica": "web-2-abc",
    }
    host = body["HostConfig"]
    assert host["PortBindings"] == {"8080/tcp": [{"HostIp": "10.0.0.5", "HostPort": "21007"}]}
    assert (host["NanoCpus"], host["Memory"], host["Init"]) == (500_000_000, 512 * 2**20, True)
    assert body["User"] == "1000:1000"
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "Count": 2, "Capabilities": [["gpu"]]}]
    assert host["Binds"] == ["models:/models:ro", "/srv/cache:/cache"]
    every = ReplicaTemplate(image="x", gpus="all")
    devices = ReplicaTemplate.model_validate({"image": "x", "gpus": ["0", "GPU-3a2f"]})
    requests = [
        container_config(Launch("web", 1, "r", t), "127.0.0.1", 1, {})["HostConfig"][
            "DeviceRequests"
        ]
        for t in (every, devices)
    ]
    assert requests == [
        [{"Driver": "nvidia", "Count": -1, "Capabilities": [["gpu"]]}],
        [{"Driver": "nvidia", "DeviceIDs": ["0", "GPU-3a2f"], "Capabilities": [["gpu"]]}],
    ]
    image_only = ReplicaTemplate(image="x")
    plain = container_config(Launch("web", 1, "r", image_only), "127.0.0.1", 1, {})
    assert "Cmd" not in plain  # the image's own command
    assert "Entrypoint" not in plain
    assert "PORT=8000" in plain["Env"]
    assert "DeviceRequests" not in plain["HostConfig"]
    assert "Binds" not in plain["HostConfig"]
    assert container_name("0123456789", Launch("web", 1, "r/1", image_only)) == (
        "gateway-01234567-web-r-1"
    )


@pytest.mark.parametrize(
    ("requested", "oom", "code", "lines", "reason"),
    [
        (True, False, 143, ["bye"], "stopped"),
        (True, False, 137, [], "stopped (SIGKILL after the grace)"),
        (False, False, 3, ["a", "fatal: x", ""], "exited with code 3: fatal: x"),
        (False, False, 127, [], "exited with code 127 (command not found)"),
        (False, False, 137, [], "killed by signal 9 (SIGKILL)"),
        (False, True, 137, ["big"], "killed: out of memory: big"),
        (False, False, None, [], "exited (exit status unknown: the container is gone)"),
    ],
)
def test_exit_reasons(
    requested: bool, oom: bool, code: int | None, lines: list[str], reason: str
) -> None:
    from controller.backends.docker.container import exit_reason

    assert exit_reason(requested, oom, code, lines) == reason


def test_the_commands_script_execs_a_plain_last_command() -> None:
    from controller.backends.docker import container_script

    assert container_script(["a", "b x"]) == "{ a\n} && { exec b x\n}"
    assert container_script(["a | b"]) == "{ a | b\n}"
    assert container_script(["X=1 run"]) == "{ X=1 run\n}"


# -- pulling.py: pull progress over a recorded stream (pure) --------------------------------


def down(current: int, total: int, layer: str) -> dict[str, object]:
    return {
        "status": "Downloading",
        "progressDetail": {"current": current, "total": total},
        "id": layer,
    }


RECORDED_PULL = [
    {"status": "Pulling from library/web", "id": "1.2"},
    {"status": "Already exists", "progressDetail": {}, "id": "aaa"},
    {"status": "Pulling fs layer", "progressDetail": {}, "id": "bbb"},
    {"status": "Pulling fs layer", "progressDetail": {}, "id": "ccc"},
    {"status": "Waiting", "progressDetail": {}, "id": "ccc"},
    down(1_000_000, 4_000_000, "bbb"),
    down(500_000, 10_000_000, "ccc"),
    down(3_000_000, 4_000_000, "bbb"),
    {"status": "Verifying Checksum", "progressDetail": {}, "id": "bbb"},
    {"status": "Download complete", "progressDetail": {}, "id": "bbb"},
    {"status": "Extracting", "progressDetail": {"current": 32768, "total": 4_000_000}, "id": "bbb"},
    {"status": "Pull complete", "progressDetail": {}, "id": "bbb"},
    down(10_000_000, 10_000_000, "ccc"),
    {"status": "Download complete", "progressDetail": {}, "id": "ccc"},
    {"status": "Pull complete", "progressDetail": {}, "id": "ccc"},
    {"status": "Digest: sha256:0123"},
    {"status": "Status: Downloaded newer image for registry.example/web:1.2"},
]  # fmt: skip


def test_pull_progress_is_summed_over_layers_and_said_every_two_seconds() -> None:
    from controller.backends.docker import PullProgress

    progress = PullProgress("registry.example/web:1.2", "a")
    said: list[tuple[float, str]] = []
    lines = []
    for i, message in enumerate(RECORDED_PULL):
        progress.feed(message)
        lines.append(progress.text())
        now = i * 0.5  # a message every half second
        if progress.due(now):
            said.append((now, progress.text()))
    head = "pulling registry.example/web:1.2 on a: "
    assert lines[1] == head + "1 of 1 layers"  # the tag's line is no layer; aaa is there
    assert lines[6] == head + "1 of 3 layers, 1.5 of 14.0 MB"
    assert lines[7] == head + "1 of 3 layers, 3.5 of 14.0 MB"
    assert lines[10] == head + "2 of 3 layers, 4.5 of 14.0 MB"  # extracting: downloaded
    assert lines[-1] == head + "3 of 3 layers, 14.0 of 14.0 MB"
    assert [at for at, _ in said] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert said[2][1] == lines[8]


# -- ssh:// engines: the engine's socket through a real sshd on loopback ----------------------


@dataclass
class Sshd:
    port: int
    options: SshOptions
    process: asyncio.subprocess.Process


@pytest.fixture
async def sshd(tmp_path: Path) -> AsyncIterator[Sshd]:
    """An ``sshd`` of its own on 127.0.0.1 (a host key and authorized_keys made here); the
    test engine's socket is the "remote" one. Root only (sshd's privilege separation)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("sshd", path="/usr/sbin:/usr/bin") is None:
        missing("needs root and openssh-server (sshd; .ci/docker.sh installs it)")
    if not ENGINE.startswith("unix://"):
        pytest.skip("the remote engine is the test engine's unix socket")
    await engine_or_skip()
    keys = tmp_path / "ssh"
    keys.mkdir()
    for name in ("host_key", "client_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True
        )
    (keys / "authorized_keys").write_text((keys / "client_key.pub").read_text())
    port = free_port()
    host_key = (keys / "host_key.pub").read_text().split()
    (keys / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key[0]} {host_key[1]}\n")
    config = keys / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {keys / 'host_key'}\n"
        f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPidFile {keys / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nAllowStreamLocalForwarding yes\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege separation directory
    with open(keys / "sshd.log", "wb") as log:
        process = await asyncio.create_subprocess_exec(
            "/usr/sbin/sshd", "-D", "-e", "-f", str(config),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
        )  # fmt: skip
    try:

        async def listening() -> bool:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return True

        await eventually(listening, timeout=5, every=0.05, what="sshd listening")
        options = SshOptions(
            str(keys / "client_key"), str(keys / "known_hosts"), ENGINE.removeprefix("unix://")
        )
        yield Sshd(port, options, process)
    finally:
        process.terminate()
        await process.wait()


async def test_an_ssh_engine_through_its_forwarded_socket_restarted_when_it_ends(
    harness: Harness, sshd: Sshd
) -> None:
    host = dataclasses.replace(
        harness.host("s", 2), engine=f"ssh://root@127.0.0.1:{sshd.port}", ssh=sshd.options
    )
    backend = harness.backend([host])
    heard: list[HostState] = []
    backend.host_listeners.append(heard.append)
    running = await backend.start(launch("r1"))
    assert running.handle["host"] == "s"
    assert await answer(running.host, running.port) == "200"
    tunnel = backend._hosts["s"].tunnel
    assert tunnel is not None
    assert tunnel.starts == 1
    pid = tunnel.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # the link went away: the child is started again
    await eventually(
        lambda: tunnel.starts == 2 and tunnel.ready.is_set(),
        timeout=15,
    )
    await eventually(lambda: backend.hosts()[0].reachable, timeout=15)
    assert [s.engine for s in heard] == [host.engine] * len(heard)
    assert not harness.exit_of("r1").done()  # nothing stopped because the link went away
    assert await answer(running.host, running.port) == "200"
    await backend.stop("r1", 1.0)
    assert harness.exit_of("r1").result().requested
    second = tunnel.pid
    await backend.close()
    assert second is not None
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)  # stopped with the backend, by its pid
    assert not os.path.exists(tunnel.local)


def test_the_ssh_command_forwards_the_remote_socket() -> None:
    options = SshOptions("/k/id", "/k/known", "/run/docker.sock")
    command = ssh_command("ssh://deploy@box.example:2222", "/tmp/g/box.sock", options)
    assert command[:2] == ["ssh", "-nNT"]
    assert command[-3:] == ["-L", "/tmp/g/box.sock:/run/docker.sock", "deploy@box.example"]
    for option in ("BatchMode=yes", "ExitOnForwardFailure=yes", "StrictHostKeyChecking=yes"):
        assert option in command
    assert ["-p", "2222"] == command[command.index("-p") : command.index("-p") + 2]
    assert "UserKnownHostsFile=/k/known" in command
    plain = ssh_command("ssh://box", "/s", SshOptions())
    assert plain[-3:] == ["-L", "/s:/var/run/docker.sock", "box"]
    assert "-p" not in plain
    assert "-i" not in plain
