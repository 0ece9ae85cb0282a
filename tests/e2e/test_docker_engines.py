"""End to end on two real Docker Engines: the test engine (``$GATEWAY_TEST_DOCKER_HOST``) as host
``a``, and a second ``dockerd`` started by this module as host ``b``.

The second engine has its own unix socket, data root, exec root, pid file and bridge (a
bridge interface made for it, on a private /24 no route of this machine uses: with ``--bridge
none`` dockerd would delete ``docker0`` under the first engine), and also listens on
``tcp://127.0.0.1:<port>`` with ``--tlsverify`` (certificates from a trustme CA). It stops
only what it started, by pid, and removes its bridge. Starting it needs root: otherwise these
tests are skipped, saying so (under ``$CI`` they fail).

Replicas publish their ports on 127.0.0.1 (docker-proxy, as ``--iptables=false``); no test
sends traffic to a bridge address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.backends.docker import EngineClient, EngineError, EngineTls, EngineUnreachable
from tests.controller.test_backend_docker import ENGINE, IMAGE, engine_or_skip, remove_labelled
from tests.needs import missing
from tests.support.eventually import GiveUp, eventually, eventually_blocking
from tests.support.ports import free_port as _free_port
from tests.support.ports import port_block

from .conftest import Gateways, Load
from .test_docker import docker_spec as plain_docker_spec

ROOTFS = Path(
    os.environ.get("GATEWAY_TEST_ROOTFS", "/var/cache/gateway-ci/rootfs-bookworm-python3.tar")
)
"""The test image's root file system, imported into the second engine."""
START_WAIT = 60.0
STOP_WAIT = 30.0


def _private_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.0.0.0/8 that overlaps no route or address of this machine."""
    used = []
    shown = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True)
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True)
    for line in shown.stdout.splitlines():
        used.append(ipaddress.ip_network(line.split()[3], strict=False))
    for line in routes.stdout.splitlines():
        first = line.split()[0]
        if first != "default":
            used.append(ipaddress.ip_network(first, strict=False))
    for third in range(200, 256):
        candidate = ipaddress.ip_network(f"10.{os.getpid() % 200 + 20}.{third}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise AssertionError("no free private /24 for the second engine's bridge")


def _ping(path: str) -> bool:
    """The engine at the unix socket ``path`` answers ``GET /_ping`` (blocking: fixture only)."""
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2)
            sock.connect(path)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.")
    except OSError:
        return False


@dataclass
class Engine:
    """A ``dockerd`` of this test module: start, stop (by signal), start again."""

    root: Path
    exec_root: Path
    bridge: str
    tcp_port: int
    tls: EngineTls
    process: subprocess.Popen[bytes] | None = None
    log: list[Path] = field(default_factory=list)

    @property
    def socket(self) -> str:
        return str(self.root / "docker.sock")

    @property
    def unix(self) -> str:
        return f"unix://{self.socket}"

    @property
    def tcp(self) -> str:
        return f"tcp://127.0.0.1:{self.tcp_port}"

    def args(self, tls_dir: Path) -> list[str]:
        config = self.root / "daemon.json"
        config.write_text("{}")  # not /etc/docker/daemon.json: nothing of the first engine's
        return [
            "dockerd",
            "--config-file", str(config),
            "--host", self.unix,
            "--host", self.tcp,
            "--tlsverify",
            "--tlscacert", str(tls_dir / "ca.pem"),
            "--tlscert", str(tls_dir / "server.pem"),
            "--tlskey", str(tls_dir / "server.key"),
            "--data-root", str(self.root / "data"),
            "--exec-root", str(self.exec_root),
            "--pidfile", str(self.root / "docker.pid"),
            "--bridge", self.bridge,
            "--iptables=false",
            "--ip-masq=false",
            "--log-level", "warn",
            # Its containers are the tests': on stop, not the 15 s grace a production engine
            # gives each running container before killing it.
            "--shutdown-timeout", "1",
        ]  # fmt: skip

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None
        log = self.root / f"dockerd-{len(self.log) + 1}.log"
        self.log.append(log)
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                self.args(self.root / "tls"),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = self.process

        def answering() -> bool:
            if process.poll() is not None:
                raise GiveUp(f"the second dockerd exited: {log.read_text()[-2000:]}")
            return _ping(self.socket)

        eventually_blocking(answering, timeout=START_WAIT, every=0.1, what="the second dockerd")

    def signal(self, signum: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after STOP_WAIT) and wait, for its containerd too: a new dockerd
        on the same exec root must not find the old containerd still on its way out."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        containerd: int | None = None
        with contextlib.suppress(OSError, ValueError):
            pid_file = self.exec_root / "containerd" / "containerd.pid"
            containerd = int(pid_file.read_text().strip())
        process.send_signal(signal.SIGCONT)  # should a test have left it stopped
        process.terminate()
        try:
            process.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if containerd is not None and _is_containerd(containerd):
            deadline = time.monotonic() + STOP_WAIT
            while _is_containerd(containerd) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _is_containerd(containerd):
                os.kill(containerd, signal.SIGKILL)
        self.unmount()

    def unmount(self) -> None:
        """Unmount what the engine left mounted under its root (a container's overlay that its
        shutdown stopped may stay mounted: the next engine could not remove it, and the
        directory could not be deleted)."""
        prefix = f"{self.root}/"
        with open("/proc/mounts") as mounts:
            points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", point], check=False, capture_output=True)


def _is_containerd(pid: int) -> bool:
    """``pid`` is a live containerd (not a pid reused by another process since)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return command.startswith(b"containerd\0") and state[state.rindex(b")") + 2 :][:1] != b"Z"


def _write_tls(ca: Any, directory: Path) -> EngineTls:
    """The engine's certificate (for 127.0.0.1) and a client's, both signed by ``ca``."""
    directory.mkdir()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.private_key_pem.write_to_path(str(directory / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(directory / "server.pem"))
    client = ca.issue_cert("gateway-test-client")
    client.private_key_pem.write_to_path(str(directory / "client.key"))
    client.cert_chain_pems[0].write_to_path(str(directory / "client.pem"))
    return EngineTls(
        str(directory / "ca.pem"), str(directory / "client.pem"), str(directory / "client.key")
    )


@pytest.fixture(scope="module")
def second_engine() -> Iterator[Engine]:
    with second_dockerd() as engine:
        yield engine


@contextlib.contextmanager
def second_dockerd() -> Iterator[Engine]:
    """The second engine, started and stopped (by pid) around the block: the fixture's, and
    bench/cluster.py's."""
    if os.geteuid() != 0:
        missing("a second dockerd (its bridge, data root and mounts) needs root")
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        missing("dockerd and the docker CLI are not installed")
    if not ROOTFS.exists():
        missing(f"{ROOTFS} (the test image's root file system) is missing")
    import trustme

    root = Path(tempfile.mkdtemp(prefix="gateway-engine-"))
    # containerd's socket lives under the exec root: keep its path short (108 bytes at most).
    exec_root = Path(tempfile.mkdtemp(prefix="gwx", dir="/tmp"))
    bridge = f"gwt{os.getpid() % 1_000_000}"
    subnet = _private_subnet()
    engine = Engine(root, exec_root, bridge, _free_port(), _write_tls(trustme.CA(), root / "tls"))
    made_bridge = False
    try:
        subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
        made_bridge = True
        gateway_address = f"{next(subnet.hosts())}/{subnet.prefixlen}"
        subprocess.run(["ip", "addr", "add", gateway_address, "dev", bridge], check=True)
        subprocess.run(["ip", "link", "set", bridge, "up"], check=True)
        engine.start()
        subprocess.run(
            ["docker", "-H", engine.unix, "import", str(ROOTFS), IMAGE],
            check=True,
            capture_output=True,
        )
        yield engine
    finally:
        engine.stop()
        engine.unmount()
        for log in engine.log:  # shown by pytest when a test of the module failed
            with contextlib.suppress(OSError):
                print(f"-- {log.name}:\n{log.read_text()[-8000:]}")
        if made_bridge:
            subprocess.run(["ip", "link", "delete", bridge], check=False)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(exec_root, ignore_errors=True)


async def remove_labelled_on(engine: str, instance: str) -> int:
    """Remove the instance's containers on the second engine; return how many ran.

    A container that dockerd's shutdown stopped may not be removable after its restart
    (overlay2: ``device or resource busy``, a mount another mount namespace still holds):
    the backend leaves it to its orphan sweep, and the data root goes with the module."""
    client = EngineClient(engine)
    try:
        found = await client.containers({"gateway.instance": instance})
        for container in found:
            try:
                await client.remove(container["Id"])
            except EngineError as exc:
                if container["State"] == "running" or "busy" not in exc.message:
                    raise
        return sum(1 for c in found if c["State"] == "running")
    finally:
        await client.close()


@pytest.fixture
async def two_engines(tmp_path: Path, second_engine: Engine) -> AsyncIterator[Gateways]:
    await engine_or_skip()
    g = Gateways(tmp_path)
    try:
        yield g
    finally:
        try:
            await g.close()
        finally:
            path = g.state_dir / "instance-id"
            if path.exists():
                instance = path.read_text().strip()
                left = await remove_labelled(instance)
                if second_engine.process is not None and second_engine.process.poll() is None:
                    left += await remove_labelled_on(second_engine.unix, instance)
                assert left == 0, "containers left"


def two_engine_config(
    g: Gateways, second: Engine, capacity: int = 3, engine_b: dict[str, Any] | None = None
) -> dict[str, Any]:
    base = port_block(20)
    hosts = [
        {
            "name": "a",
            "engine": ENGINE,
            "capacity": {"replicas": capacity},
            "port_range": f"{base}-{base + 9}",
        },
        {
            "name": "b",
            "engine": second.unix,
            "capacity": {"replicas": capacity},
            "port_range": f"{base + 10}-{base + 19}",
            **(engine_b or {}),
        },
    ]
    return {"process": {"port_range": g.port_range}, "docker": {"hosts": hosts}}


def docker_spec(version: str, replicas: int) -> dict[str, Any]:
    return plain_docker_spec(version, replicas, pull="never")


def placed(gw: Any) -> dict[str, str]:
    """Replica id -> the host its container runs on."""
    return {rid: r.handle["host"] for rid, r in gw.controller.executor.running.items()}


def hosts_of(gw: Any) -> list[str]:
    return sorted(placed(gw).values())


async def host_up(gw: Any, host: str) -> float:
    admin = f"http://127.0.0.1:{gw.gateway.admin.port}/metrics"
    async with aiohttp.ClientSession() as http, http.get(admin) as response:
        text = await response.text()
    series = f'gateway_docker_host_up{{host="{host}"}} '
    line = next(line for line in text.splitlines() if line.startswith(series))
    return float(line.removeprefix(series))


def journal(gw: Any, kind: str) -> list[str]:
    return [e.message for e in gw.controller.journal.since(0) if e.kind == kind]


LIVE_STATES = ("requested", "starting", "ready", "unhealthy")


def live(gw: Any) -> list[Any]:
    return [r for r in gw.state().observed.replicas if r.state in LIVE_STATES]


async def serving_four(gw: Any) -> None:
    """Four ready replicas of revision 1, its rollout done (containers start slower than
    processes: up to 30 s on a busy machine)."""
    await gw.controller.apply(docker_spec("v1", 4))
    await eventually(
        lambda: (
            gw.ready(1) == 4
            and gw.state().observed.serving_revision == 1
            and gw.state().observed.rollout is None
        ),
        timeout=30,
        what="4 ready replicas of revision 1",
    )


# -- the tests ------------------------------------------------------------------------------------


def tls_host(second: Engine) -> dict[str, Any]:
    """Host b as the second engine's TLS listener, with the client's files."""
    return {"engine": second.tcp, "tls": dataclasses.asdict(second.tls)}


async def test_a_tls_engine_answers_only_a_client_with_a_certificate_of_its_ca(
    second_engine: Engine, tmp_path: Path
) -> None:
    import trustme

    trusted = EngineClient(second_engine.tcp, second_engine.tls)
    try:
        await trusted.ping()
    finally:
        await trusted.close()
    stranger = _write_tls(trustme.CA(), tmp_path / "other")  # a CA the engine does not know
    cases = [
        # The engine's certificate is not signed by the CA the client trusts.
        (stranger, "certificate verify failed"),
        # The client's certificate is not of the engine's CA: the engine ends the handshake.
        (
            dataclasses.replace(
                second_engine.tls, cert_file=stranger.cert_file, key_file=stranger.key_file
            ),
            "",
        ),
    ]
    for tls, why in cases:
        client = EngineClient(second_engine.tcp, tls)
        try:
            with pytest.raises(EngineUnreachable, match=f"engine {second_engine.tcp}: .*{why}"):
                await client.ping()
        finally:
            await client.close()
    plain = EngineClient(second_engine.tcp)  # plain HTTP to the TLS port: the engine says so
    try:
        with pytest.raises(EngineError, match="HTTP request to an HTTPS server"):
            await plain.ping()
    finally:
        await plain.close()


async def test_a_rolling_update_over_two_engines_costs_no_request(
    two_engines: Gateways, second_engine: Engine
) -> None:
    """Host b is the second engine's TLS listener (tcp://127.0.0.1, client certificate)."""
    config = two_engine_config(two_engines, second_engine, engine_b=tls_host(second_engine))
    gw = await two_engines.start(backends=config)
    await serving_four(gw)
    assert hosts_of(gw) == ["a", "a", "b", "b"]
    async with Load(gw.url) as load:
        await load.more()
        assert load.bodies() == {"v1"}
        result = await gw.controller.apply(docker_spec("v2", 4))
        assert (result.action, result.revision) == ("rollout", 2)
        await eventually(
            lambda: (
                gw.state().observed.rollout is None
                and gw.ready(2) == 4
                and not [r for r in live(gw) if r.revision == 1]
            ),
            timeout=60,
            what="four ready replicas of revision 2 only",
        )
        after = load.mark()
        await load.more()
    assert not load.failures, load.summary()
    assert load.bodies(after) == {"v2"}
    assert gw.rollouts()[0].status == "complete"
    await eventually(
        lambda: len(placed(gw)) == 4, timeout=10, what="the revision-1 containers to be gone"
    )
    assert hosts_of(gw) == ["a", "a", "b", "b"]
    # Host b's containers are on the second engine, not on the first. A stopped revision-1
    # container is removed after its exit is reported, so the engine's list catches up.
    instance = (two_engines.state_dir / "instance-id").read_text().strip()
    expected = sorted(
        gw.controller.executor.running[rid].handle["container"]
        for rid, host in placed(gw).items()
        if host == "b"
    )
    client = EngineClient(second_engine.tcp, second_engine.tls)
    try:

        async def listed() -> bool:
            on_b = sorted(c["Id"] for c in await client.containers({"gateway.instance": instance}))
            assert on_b == expected  # the last list is in the failure
            return True

        await eventually(listed, every=0.1, what="the second engine's containers as placed")
    finally:
        await client.close()


async def test_the_second_engine_stopped_and_started_again(
    two_engines: Gateways, second_engine: Engine
) -> None:
    """SIGTERM to dockerd (live-restore off) stops its containers with it: their exits are
    replica exits, host b reads unreachable, and no replacement can be placed (a is full): the
    service is degraded, never stopped, and never holds more than its 4 replicas. Once b
    answers again its replicas are replaced there; requests sent after that all succeed."""
    gw = await two_engines.start(backends=two_engine_config(two_engines, second_engine, 2))
    await serving_four(gw)
    before = placed(gw)
    on_a = {rid for rid, host in before.items() if host == "a"}
    assert sorted(before.values()) == ["a", "a", "b", "b"]
    assert await host_up(gw, "b") == 1
    most = 0

    def counted() -> int:
        nonlocal most
        most = max(most, len(placed(gw)))
        return most

    async with Load(gw.url) as load:
        await load.more()
        await asyncio.to_thread(second_engine.stop)  # off the loop: the gateway serves on
        stopped_at = time.monotonic()
        await eventually(
            lambda: journal(gw, "host_unreachable"), timeout=15, what="host b unreachable"
        )
        await eventually(
            lambda: not gw.controller.backends["docker"].hosts()[1].reachable,
            timeout=15,
            what="b down",
        )
        assert await host_up(gw, "b") == 0
        degraded = await eventually(
            lambda: counted() and "b: unreachable" in (gw.state().observed.degraded or ""),
            timeout=15,
            what="web degraded: host b unreachable",
        )
        # a's replicas untouched. (A replacement may have been started on b while its dockerd
        # was shutting down, which still takes requests: it dies with it, counted below.)
        assert on_a <= set(placed(gw))
        await load.more()
        # While dockerd shuts down it still serves the connections it has: host b may read
        # reachable again through one of them for a moment. What counts is after the restart.
        reachable = len(journal(gw, "host_reachable"))
        await asyncio.to_thread(second_engine.start)
        await eventually(
            lambda: (
                len(journal(gw, "host_reachable")) > reachable
                and gw.controller.backends["docker"].hosts()[1].reachable
            ),
            timeout=30,
            what="host b reachable again",
        )
        assert await host_up(gw, "b") == 1
        await eventually(
            lambda: counted() and gw.ready(1) == 4 and not gw.state().observed.degraded,
            timeout=30,
            what="host b's two replicas to be replaced and web to recover",
        )
        after = load.mark()
        await load.more()
    assert degraded
    assert most <= 4, "more replicas than desired"
    now = placed(gw)
    assert sorted(now.values()) == ["a", "a", "b", "b"]
    assert on_a <= set(now)
    assert not set(now) & {rid for rid, host in before.items() if host == "b"}
    assert gw.state().desired.replicas == 4
    assert gw.state().observed.rollout is None
    assert [m for m in journal(gw, "host_unreachable") if "docker host b" in m]
    # Only requests in flight on b's containers as they were stopped may fail.
    assert len(load.failures) <= load.clients, load.summary()
    assert all(o.at <= stopped_at for o in load.failures), load.summary()
    assert not [o for o in load.sent_since(after) if o.failed], load.summary()
    assert load.bodies(after) == {"v1"}


async def test_the_second_engine_frozen_and_thawed_keeps_its_replicas(
    two_engines: Gateways, second_engine: Engine
) -> None:
    """SIGSTOP: the engine keeps its sockets open and answers nothing; its containers serve
    on. The heartbeat reports host b unreachable; nothing is stopped, started or replaced,
    and no request fails. SIGCONT: reachable again, the same replicas."""
    gw = await two_engines.start(backends=two_engine_config(two_engines, second_engine, 2))
    await serving_four(gw)
    before = placed(gw)
    async with Load(gw.url) as load:
        await load.more()
        second_engine.signal(signal.SIGSTOP)
        try:
            await eventually(
                lambda: journal(gw, "host_unreachable"), timeout=15, what="host b unreachable"
            )
            assert await host_up(gw, "b") == 0
            await load.more()
            assert placed(gw) == before
        finally:
            second_engine.signal(signal.SIGCONT)
        await eventually(
            lambda: journal(gw, "host_reachable"), timeout=40, what="host b reachable again"
        )
        assert await host_up(gw, "b") == 1
        await load.more()
    assert not load.failures, load.summary()
    assert placed(gw) == before
    assert not journal(gw, "replica_failed")
    assert gw.ready(1) == 4
    assert load.bodies() == {"v1"}


async def test_apply_following_prints_the_pull_progress_the_backend_reports(
    gateways: Gateways, tmp_path: Path
) -> None:
    """Backend -> journal (image_pulling, the service's) -> /api/events -> the follower's
    lines. No registry here to pull from: the lines are those of a recorded pull stream, as the
    backend's throttle lets them through, handed to what the gateway wired to the backend."""
    from controller.backends.docker import PullProgress
    from controller.cli.admin_api import Client, Target
    from controller.cli.following import say_pulls
    from tests.controller.test_backend_docker import RECORDED_PULL

    gone = {"name": "a", "engine": f"unix://{tmp_path}/no-engine.sock", "port_range": "24990-24999"}
    gw = await gateways.start(
        backends={"process": {"port_range": gateways.port_range}, "docker": {"hosts": [gone]}}
    )
    backend = gw.controller.backends["docker"]
    progress = PullProgress("registry.example/web:1.2", "a", "web")
    lines = []
    for i, message in enumerate(RECORDED_PULL):
        progress.feed(message)
        if progress.due(i * 0.5):
            lines.append(progress.text())
    said: list[str] = []
    url = f"http://127.0.0.1:{gw.gateway.admin.port}"
    async with aiohttp.ClientSession() as session:
        client = Client(session, Target(url, None))
        following = asyncio.create_task(say_pulls(client, "web", said.append))
        try:
            # The stream is open once a line said before the pull comes through.
            assert backend.pull_listeners, "nothing hears the backend's pulls"

            def heard() -> bool:
                if said:  # the last line sent had its 50 ms to come through
                    return True
                for listener in backend.pull_listeners:
                    listener("web", "pulling ready")
                return False

            await eventually(heard, timeout=5, every=0.05, what="a pull line the follower heard")
            said.clear()
            gw.controller.journal.record("web", "service_updated", "not a pull line")
            for listener in backend.pull_listeners:
                listener("api", "another service's pull")
                for line in lines:
                    listener("web", line)
            await eventually(lambda: len(said) >= len(lines), timeout=5, what="the pull lines")
        finally:
            following.cancel()
    assert said == lines
    assert said[-1] == "pulling registry.example/web:1.2 on a: 3 of 3 layers, 14.0 of 14.0 MB"
    entries = [e for e in gw.controller.journal.since(0) if e.kind == "image_pulling"]
    assert {e.service for e in entries} == {"web", "api"}
