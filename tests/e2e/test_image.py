"""The project's image, built from this checkout and run: ``/healthz`` answers, a request is
proxied to a replica, the gateway runs as uid 10001, the data plane is compiled.

The Dockerfile is built once (``docker build --network host``) from the local bases that
``.ci/docker.sh`` makes with debootstrap, as this machine reaches no image registry:
``$GATEWAY_TEST_BUILD_BASE`` and ``$GATEWAY_TEST_RUN_BASE`` on the engine
``$GATEWAY_TEST_DOCKER_HOST``, their interpreter ``$GATEWAY_TEST_BASE_PYTHON`` (Debian's by
default). ``$GATEWAY_TEST_BUILD_CA_CERTS`` (a PEM file or a directory of ``.crt`` files) is
passed to the build stage's pip, and must not show in the final image. Without the bases
configured the tests skip, and under CI (``$CI``) they fail instead.

The container runs the image as built, with the demo config and its default command; its
traffic port is published on 127.0.0.1 only, and ``/healthz`` is asked inside the container
(the demo's admin listener is its loopback), by ``docker exec`` and by the image's own
HEALTHCHECK. Every container and image the module made is removed at its end.

The build takes minutes, most of them the compiler's (the profile-guided native build, on
one core): when this module is among the tests a session runs, ``conftest`` starts it as
soon as the tests are collected (``start_early``), at the lowest CPU weight
(``--cpu-shares 2``), so that it uses what the tests before this module leave idle, and
this module's fixture waits for what is left of it. The tests take the CPU first: a build
that had none yet runs alone once they wait for it, as it did when it began there.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.needs import missing
from tests.support.eventually import eventually

ENGINE = os.environ.get("GATEWAY_TEST_DOCKER_HOST", "unix:///var/run/docker.sock")
BUILD_BASE = os.environ.get("GATEWAY_TEST_BUILD_BASE", "")
RUN_BASE = os.environ.get("GATEWAY_TEST_RUN_BASE", "")
PYTHON = os.environ.get("GATEWAY_TEST_BASE_PYTHON", "/usr/bin/python3")
CA_CERTS = os.environ.get("GATEWAY_TEST_BUILD_CA_CERTS", "")
INDEX_URL = os.environ.get("GATEWAY_TEST_BUILD_INDEX_URL", "")
ROOT = Path(__file__).resolve().parents[2]
RUN = "gateway.test.image"
"""The label on every container the module runs: its value is the module's run id."""

# The image build (minutes: see the module docstring) ends in the setup of the first test that
# uses it.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The docker CLI on the test engine. The legacy builder: the engines here have no buildx
    (Debian's docker.io), and its output names each stage's image, which teardown removes."""
    env = {**os.environ, "DOCKER_HOST": ENGINE, "DOCKER_BUILDKIT": "0"}
    return subprocess.run(
        ["docker", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def unavailable() -> str | None:
    """Why the image cannot be built here (None: it can)."""
    if not (BUILD_BASE and RUN_BASE):
        return "no base images configured (GATEWAY_TEST_BUILD_BASE, GATEWAY_TEST_RUN_BASE)"
    if shutil.which("docker") is None:
        return "no docker CLI"
    if docker("version").returncode != 0:
        return f"no Docker Engine at {ENGINE}"
    for base in (BUILD_BASE, RUN_BASE):
        if docker("image", "inspect", base).returncode != 0:
            return f"base image {base} missing on {ENGINE} (.ci/docker.sh imports it)"
    return None


def ca_certs(path: str) -> str:
    """The PEM text of ``path``: a file, or every ``.crt`` file under a directory."""
    if not path or not Path(path).exists():
        return ""
    root = Path(path)
    files = sorted(root.rglob("*.crt")) if root.is_dir() else [root]
    return "".join(f.read_text() for f in files)


def stage_images(output: str) -> list[str]:
    """The image each stage of a legacy build ended with, from the builder's output."""
    last: list[str] = []
    for line in output.splitlines():
        if re.match(r"Step \d+/\d+ : FROM ", line):
            last.append("")
        elif (found := re.fullmatch(r" ---> ([0-9a-f]{12})", line)) and last:
            last[-1] = found[1]
    return [image for image in last if image]


@dataclass(frozen=True)
class Image:
    tag: str
    run: str


@dataclass
class Build:
    """A ``docker build`` of this checkout under way (the legacy builder, whose output
    names each stage's image)."""

    tag: str
    run: str
    process: subprocess.Popen[str]
    started: float

    def wait(self, timeout: float) -> tuple[int, str]:
        """The build's exit status and output, once it is over (killed after ``timeout``
        seconds more)."""
        try:
            output, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
            return -1, f"{output}\ntimed out after {time.monotonic() - self.started:.0f}s"
        return self.process.returncode, output


def start_build() -> Build:
    run = uuid.uuid4().hex[:12]
    tag = f"gateway-test/image:{run}"
    args = [
        "build",
        "--network=host",
        "--force-rm",
        # The lowest weight: beside the tests, the build takes only the CPU they leave.
        "--cpu-shares=2",
        f"--build-arg=BUILD_BASE={BUILD_BASE}",
        f"--build-arg=RUN_BASE={RUN_BASE}",
        f"--build-arg=PYTHON={PYTHON}",
        f"--build-arg=BUILD_CA_CERTS={ca_certs(CA_CERTS)}",
        f"--build-arg=BUILD_INDEX_URL={INDEX_URL}",
        f"--tag={tag}",
        str(ROOT),
    ]
    env = {**os.environ, "DOCKER_HOST": ENGINE, "DOCKER_BUILDKIT": "0"}
    process = subprocess.Popen(
        ["docker", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return Build(tag, run, process, time.monotonic())


_early: list[Build] = []
"""The build ``start_early`` started for this session, until the fixture takes it."""


def start_early() -> None:
    """Start the build now, if it can be made here (``conftest``, once the session's tests
    are collected and this module is among them)."""
    if not _early and unavailable() is None:
        _early.append(start_build())


def abandon_early() -> None:
    """Stop a build started early that no test took (the session ended first), and remove
    what it made: its image if it got that far, else the images of the steps it committed
    (the last one named in its output, with its untagged parents)."""
    while _early:
        build = _early.pop()
        _, output = build.wait(timeout=0)
        docker("rmi", "-f", build.tag)
        # The engine stops the step under way (its container uses the image) only once it
        # notices the client gone: a few seconds.
        remove_stages(output, patience=30)


def remove_stages(output: str, patience: float = 0) -> None:
    """The image each stage of a build ended with (``stage_images``), and its untagged
    parents: nobody's parent once the build's tag is removed. One still in use is tried
    again for ``patience`` seconds."""
    for stage in reversed(stage_images(output)):
        deadline = time.monotonic() + patience
        while (removed := docker("rmi", stage)).returncode != 0:
            if "No such image" in removed.stderr or time.monotonic() >= deadline:
                break  # gone with the tag (the last stage's), or still held
            time.sleep(0.5)


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    if why := unavailable():
        missing(why)
    build = _early.pop() if _early else start_build()
    waited = time.monotonic()
    status, output = build.wait(timeout=600)
    now = time.monotonic()
    print(
        f"\nimage {build.tag} built in {now - build.started:.0f}s "
        f"(the last {now - waited:.0f}s waited for)",
        file=sys.stderr,
    )
    try:
        assert status == 0, f"docker build failed:\n{output[-4000:]}"
        yield Image(build.tag, build.run)
    finally:
        containers = docker("ps", "-aq", "--filter", f"label={RUN}={build.run}").stdout.split()
        if containers:
            docker("rm", "-f", *containers)
        docker("rmi", "-f", build.tag)
        remove_stages(output)
        assert docker("image", "inspect", build.tag).returncode != 0, f"{build.tag} left"


@dataclass(frozen=True)
class Container:
    id: str
    traffic: str
    """The published traffic port: ``http://127.0.0.1:<port>``."""

    def logs(self) -> str:
        done = docker("logs", "--tail", "40", self.id)
        return done.stdout + done.stderr

    def exec(self, *command: str) -> str:
        done = docker("exec", self.id, *command)
        assert done.returncode == 0, f"{command}: {done.stderr}\n{self.logs()}"
        return done.stdout


@pytest.fixture(scope="module")
def container(image: Image) -> Container:
    """The image with its default command (the demo config, workers auto); removed with the
    image. The health check every second instead of ten: the image's own command, sooner."""
    started = docker(
        "run",
        "--detach",
        f"--label={RUN}={image.run}",
        "--publish=127.0.0.1::8080",
        "--health-interval=1s",
        image.tag,
    )
    assert started.returncode == 0, started.stderr
    cid = started.stdout.strip()
    port = docker("port", cid, "8080/tcp").stdout.split()[0]
    assert port.startswith("127.0.0.1:"), f"published on {port}, not on loopback only"
    return Container(cid, f"http://{port}")


async def in_container(
    check: Callable[[], bool], timeout: float, what: str, logs: Container
) -> None:
    """``eventually`` for a check that runs ``docker`` (in a thread, every 0.5 s); a failure
    shows the container's log."""
    try:
        await eventually(lambda: asyncio.to_thread(check), timeout=timeout, every=0.5, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{logs.logs()}") from e


def test_native_status_says_compiled(image: Image) -> None:
    done = docker("run", "--rm", f"--label={RUN}={image.run}", image.tag, "native", "status")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("compiled (mypyc): "), done.stdout


def test_the_image_s_compiled_modules_were_trained_on_a_profile(image: Image) -> None:
    """The image builds as ``gateway native build`` does by default: compiled twice, the
    second time guided by the training load's profile (``native_training``)."""
    show = "import json; from gateway import native; print(json.loads(native.MANIFEST.read_text()))"
    done = docker(
        "run", "--rm", f"--label={RUN}={image.run}", "--entrypoint", "python", image.tag,
        "-c", show,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "'profile': 'trained'" in done.stdout, done.stdout


def test_build_arguments_stay_out_of_the_image(image: Image) -> None:
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image.tag)
    assert history.returncode == 0, history.stderr
    assert "BUILD_CA_CERTS" not in history.stdout
    assert "BEGIN CERTIFICATE" not in history.stdout
    env = docker("image", "inspect", "--format", "{{json .Config.Env}}", image.tag).stdout
    assert "PIP_" not in env, env
    assert "BUILD_" not in env, env


async def test_healthz_answers_on_the_admin_port(container: Container) -> None:
    fetch = (
        "import urllib.request; r = urllib.request.urlopen("
        "'http://127.0.0.1:8081/healthz', timeout=2); print(r.status, r.read().decode())"
    )

    def answered() -> bool:
        return docker("exec", container.id, "python", "-c", fetch).returncode == 0

    await in_container(answered, 60, "/healthz on the admin port", container)
    status, _, body = container.exec("python", "-c", fetch).partition(" ")
    assert status == "200", body

    def healthy() -> bool:
        state = docker("inspect", "--format", "{{.State.Health.Status}}", container.id)
        return state.stdout.strip() == "healthy"

    await in_container(healthy, 30, "the image's HEALTHCHECK to pass", container)


async def test_a_request_is_proxied_to_a_replica(container: Container) -> None:
    answers: list[dict[str, str]] = []

    def proxied() -> bool:
        try:
            with urllib.request.urlopen(f"{container.traffic}/hello/ping", timeout=5) as r:
                answers.append(json.loads(r.read()))
                return True
        except OSError:
            return False  # the gateway or the replica not ready yet: 503 or refused

    await in_container(proxied, 60, "a proxied answer from a hello replica", container)
    answer = answers[-1]
    assert answer["message"].startswith("hello from hello-"), answer
    assert answer["path"] == "/ping", answer
    # The data plane that served it: the compiled modules, as the gateway logs at start.
    logs = docker("logs", container.id)
    assert "data plane: compiled (mypyc)" in logs.stdout + logs.stderr


def test_runs_as_non_root(container: Container) -> None:
    assert container.exec("id", "-u").strip() == "10001"
    # The gateway itself (pid 1, the entrypoint), not only what docker exec starts.
    uid = re.search(r"^Uid:\s+(.*)$", container.exec("cat", "/proc/1/status"), re.M)
    assert uid is not None
    assert set(uid[1].split()) == {"10001"}, uid[1]


async def test_no_process_compiles_a_module_from_its_source(image: Image) -> None:
    """The image holds the bytecode of all its processes import, at the levels they run (the
    Dockerfile's ``compileall``): the gateway and the demo's replicas at 0, its workers at 2.
    With ``PYTHONVERBOSE`` the import system says where each module's code came from:
    ``code object from '<...>.pyc'`` (its cache) or ``code object from <...>.py`` (compiled
    at import). The image's default command serves a request through a worker, and no
    process compiled a module."""
    started = docker(
        "run", "--detach", f"--label={RUN}={image.run}", "--publish=127.0.0.1::8080",
        "--env=PYTHONVERBOSE=1", image.tag,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    cid = started.stdout.strip()
    port = docker("port", cid, "8080/tcp").stdout.split()[0]
    container = Container(cid, f"http://{port}")

    def proxied() -> bool:
        try:
            with urllib.request.urlopen(f"{container.traffic}/hello/ping", timeout=5) as r:
                status: int = r.status
        except OSError:
            return False
        return status == 200

    await in_container(proxied, 60, "a proxied answer from a hello replica", container)
    done = docker("logs", cid)
    logs = done.stdout + done.stderr
    compiled = sorted(set(re.findall(r"^# code object from (/\S+\.py)$", logs, re.M)))
    assert compiled == [], f"compiled from the source at import: {compiled}"
    # A worker's modules came from their level 2 caches: the check saw them load.
    cached_at_2 = r"^# code object from '/\S+/uvloop/\S+\.opt-2\.pyc'$"
    assert re.search(cached_at_2, logs, re.M), logs[-2000:]
