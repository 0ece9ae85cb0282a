"""The config's ``backends.docker``: validated at load, and off unless configured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.config import ConfigError, load_config
from controller.main import docker_backend


def write(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(config))
    return path


def test_docker_hosts_are_read_with_their_defaults(tmp_path: Path) -> None:
    hosts = [
        {"name": "a", "engine": "unix:///var/run/docker.sock", "capacity": {"replicas": 2}},
        {"name": "gpu-1", "engine": "tcp://10.0.0.7:2375", "address": "10.0.0.7"},
    ]
    loaded = load_config(write(tmp_path, {"backends": {"docker": {"hosts": hosts}}}))
    docker = loaded.config.backends.docker
    assert docker is not None
    a, gpu = docker.hosts
    assert (a.address, a.capacity.replicas, a.ports) == ("127.0.0.1", 2, (21000, 21999))
    assert (gpu.address, gpu.capacity.replicas) == ("10.0.0.7", 8)
    backend = docker_backend(loaded.config, "instance")
    assert (backend.capacity, backend.in_use) == (10, 0)


def test_orphan_grace_is_read_and_reaches_the_backend(tmp_path: Path) -> None:
    hosts = [{"name": "a", "engine": "unix:///var/run/docker.sock"}]
    docker = {"hosts": hosts, "orphan_grace": "2m"}
    loaded = load_config(write(tmp_path, {"backends": {"docker": docker}}))
    assert loaded.config.backends.docker is not None
    assert loaded.config.backends.docker.orphan_grace == 120.0
    assert docker_backend(loaded.config, "instance").orphan_grace == 120.0


def test_without_backends_docker_there_is_none(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, {})).config.backends.docker is None


@pytest.mark.parametrize(
    ("docker", "message"),
    [
        ({"hosts": []}, "backends.docker.hosts: Tuple should have at least 1 item"),
        (
            {"hosts": [{"name": "a", "engine": "ssh://me@h"}]},
            "backends.docker.hosts.0.engine: must be unix:///PATH or tcp://HOST:PORT",
        ),
        (
            {"hosts": [{"name": "a", "engine": "tcp://h"}]},
            "backends.docker.hosts.0.engine: must be unix:///PATH or tcp://HOST:PORT",
        ),
        (
            {"hosts": [{"name": "a"}, {"name": "a"}]},
            "backends.docker.hosts: host 'a' is listed more than once",
        ),
        (
            {"hosts": [{"name": "a", "port_range": "9-1"}]},
            "backends.docker.hosts.0.port_range: ports must satisfy",
        ),
        ({"hosts": [{"name": "Big_Host"}]}, "backends.docker.hosts.0.name"),
        ({"hosts": [{"name": "a", "capacity": {"replicas": -1}}]}, "capacity.replicas"),
    ],
)
def test_bad_docker_hosts_are_refused_naming_the_field(
    tmp_path: Path, docker: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, {"backends": {"docker": docker}}))
    assert message in str(caught.value)
