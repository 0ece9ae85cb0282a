"""The config's ``backends.docker``: validated at load, and off unless configured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.config import ConfigError, load_config
from controller.serving import docker_backend


def write(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(config))
    return path


def test_docker_hosts_are_read_with_their_defaults(tmp_path: Path) -> None:
    hosts = [
        {"name": "a", "engine": "unix:///var/run/docker.sock", "capacity": {"replicas": 2}},
        {
            "name": "gpu-1",
            "engine": "tcp://10.0.0.7:2375",
            "address": "10.0.0.7",
            "capacity": {"gpu_ids": ["GPU-a", "GPU-b"]},
        },
    ]
    loaded = load_config(write(tmp_path, {"backends": {"docker": {"hosts": hosts}}}))
    docker = loaded.config.backends.docker
    assert docker is not None
    a, gpu = docker.hosts
    assert (a.address, a.capacity.replicas, a.ports) == ("127.0.0.1", 2, (21000, 21999))
    assert (gpu.address, gpu.capacity.replicas) == ("10.0.0.7", 8)
    backend = docker_backend(loaded.config, "instance")
    assert (backend.capacity, backend.in_use) == (10, 0)
    devices = [(h.config.gpus, h.config.devices) for h in backend._hosts.values()]
    assert devices == [(0, ()), (2, ("GPU-a", "GPU-b"))]


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
            {"hosts": [{"name": "a", "engine": "ssh://me:secret@h"}]},
            "backends.docker.hosts.0.engine: must be unix:///PATH, tcp://HOST:PORT or "
            "ssh://[USER@]HOST[:PORT]",
        ),
        (
            {"hosts": [{"name": "a", "engine": "ssh://me@h:port"}]},
            "backends.docker.hosts.0.engine: must be unix:///PATH",
        ),
        (
            {"hosts": [{"name": "a", "engine": "http://h:2376"}]},
            "backends.docker.hosts.0.engine: must be unix:///PATH",
        ),
        (
            {"hosts": [{"name": "a", "ssh": {"socket": "/run/docker.sock"}}]},
            "backends.docker.hosts.0: ssh: only for an ssh:// engine",
        ),
        (
            {"hosts": [{"name": "a", "engine": "ssh://h", "ssh": {"identity_file": "id"}}]},
            "backends.docker.hosts.0.ssh.identity_file: must be an absolute path",
        ),
        (
            {"hosts": [{"name": "a", "engine": "ssh://h", "ssh": {"socket": "docker.sock"}}]},
            "backends.docker.hosts.0.ssh.socket",
        ),
        ({"hosts": [{"name": "a", "capacity": {"gpus": -1}}]}, "capacity.gpus"),
        (
            {"hosts": [{"name": "a", "capacity": {"gpus": 3, "gpu_ids": ["GPU-a", "GPU-b"]}}]},
            "backends.docker.hosts.0.capacity: gpus: 3, but 2 gpu_ids",
        ),
        (
            {"hosts": [{"name": "a", "capacity": {"gpu_ids": ["GPU-a", "GPU-a"]}}]},
            "capacity: gpu_ids: a device id is listed twice",
        ),
        (
            {"hosts": [{"name": "a", "engine": "tcp://h"}]},
            "backends.docker.hosts.0.engine: must be unix:///PATH, tcp://HOST:PORT or ssh://",
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


def test_a_tls_engine_is_read_and_reaches_the_backend(tmp_path: Path) -> None:
    files = {}
    for name in ("ca_file", "cert_file", "key_file"):
        files[name] = str(tmp_path / f"{name}.pem")
        (tmp_path / f"{name}.pem").write_text("not read at load")
    hosts = [
        {
            "name": "box",
            "engine": "tcp://box.example:2376",
            "tls": files,
            "capacity": {"replicas": 4, "gpus": 2},
        }
    ]
    loaded = load_config(write(tmp_path, {"backends": {"docker": {"hosts": hosts}}}))
    assert loaded.config.backends.docker is not None
    (box,) = loaded.config.backends.docker.hosts
    assert box.tls is not None
    assert (box.tls.ca_file, box.capacity.gpus) == (files["ca_file"], 2)
    plain = {"name": "a", "engine": "tcp://10.0.0.7:2375"}
    loaded = load_config(write(tmp_path, {"backends": {"docker": {"hosts": [plain]}}}))
    assert loaded.config.backends.docker is not None
    assert loaded.config.backends.docker.hosts[0].tls is None  # plain TCP stays allowed


def test_bad_tls_files_are_refused_naming_the_field(tmp_path: Path) -> None:
    good = tmp_path / "ok.pem"
    good.write_text("x")
    files = {"ca_file": str(good), "cert_file": str(good), "key_file": str(good)}
    cases = [
        (
            {**files, "ca_file": "ca.pem"},
            "tcp://h:2376",
            "hosts.0.tls.ca_file: must be an absolute path",
        ),
        (
            {**files, "key_file": str(tmp_path / "gone.pem")},
            "tcp://h:2376",
            f"tls.key_file: no such file: {tmp_path / 'gone.pem'}",
        ),
        (files, "unix:///var/run/docker.sock", "hosts.0: tls: only for a tcp:// engine"),
        ({"ca_file": str(good)}, "tcp://h:2376", "tls.cert_file: Field required"),
    ]
    for tls, engine, message in cases:
        host = {"name": "a", "engine": engine, "tls": tls}
        with pytest.raises(ConfigError) as caught:
            load_config(write(tmp_path, {"backends": {"docker": {"hosts": [host]}}}))
        assert message in str(caught.value)


def test_an_ssh_engine_is_read_and_reaches_the_backend(tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text("not read at load")
    ssh = {"identity_file": str(key), "socket": "/run/user/1000/docker.sock"}
    hosts = [{"name": "box", "engine": "ssh://deploy@box.example:2222", "ssh": ssh}]
    loaded = load_config(write(tmp_path, {"backends": {"docker": {"hosts": hosts}}}))
    assert loaded.config.backends.docker is not None
    (box,) = loaded.config.backends.docker.hosts
    assert box.ssh is not None
    assert (box.ssh.identity_file, box.ssh.known_hosts_file) == (str(key), None)
    backend = docker_backend(loaded.config, "instance")
    (state,) = backend.hosts()
    assert state.engine == "ssh://deploy@box.example:2222"
    plain = {"name": "b", "engine": "ssh://box.example"}  # ssh's own keys and known hosts
    loaded = load_config(write(tmp_path, {"backends": {"docker": {"hosts": [plain]}}}))
    assert loaded.config.backends.docker is not None
    assert loaded.config.backends.docker.hosts[0].ssh is None
