"""What a replica's container is made of, and what its end says. Pure: no I/O.

``container_config`` is the body of ``POST /containers/create`` for one launch: the image, the
template's commands as one ``/bin/sh -c`` script (they replace the image's entrypoint and
command), its env plus ``PORT`` (the container's port, ``DEFAULT_CONTAINER_PORT`` unless the
template sets one), ``HOST``, ``REPLICA_ID``, ``SERVICE`` and ``REVISION``, the labels, the port
published on one host address only, an init as PID 1, no restart policy (the controller
replaces a replica that ended), the template's CPU and memory limits and user, its GPUs (as
``docker run --gpus``: a device request to the ``nvidia`` driver) and its volumes (``Binds``,
Docker's short syntax: a named volume missing on the host is made by the engine).
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from ..base import Launch

DEFAULT_CONTAINER_PORT = 8000
"""The container's port when the template gives none; ``$PORT`` inside the container."""
LABEL = "gateway."
"""The prefix of the labels the backend puts on its containers."""
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")
_SHELL_WORDS = frozenset(
    "! { } ( ) . : [ [[ alias break case cd command continue do done elif else esac eval exec "
    "exit export fi for if in readonly read return set shift source then times trap ulimit "
    "umask unalias unset until wait while".split()
)


def container_name(instance: str, launch: Launch) -> str:
    name = f"gateway-{instance[:8]}-{launch.service}-{launch.replica_id}"
    return _NAME_UNSAFE.sub("-", name)[:200]


def container_config(
    launch: Launch,
    address: str,
    host_port: int,
    labels: Mapping[str, str],
    gpus: Sequence[str] = (),
) -> dict[str, Any]:
    """The create body of ``launch``'s container, its port published at ``address:host_port``
    and labelled with ``labels`` plus the launch's service, revision and replica id; ``gpus``:
    the device ids placement gave it (label ``gateway.gpus``; none: as the template asks)."""
    template = launch.template
    port = template.port or DEFAULT_CONTAINER_PORT
    env = {
        **template.env,
        "PORT": str(port),
        "HOST": "0.0.0.0",
        "REPLICA_ID": launch.replica_id,
        "SERVICE": launch.service,
        "REVISION": str(launch.revision),
    }
    host_config: dict[str, Any] = {
        "PortBindings": {f"{port}/tcp": [{"HostIp": address, "HostPort": str(host_port)}]},
        # An init as PID 1 passes SIGTERM on (a server as PID 1 would ignore it).
        "Init": True,
        "RestartPolicy": {"Name": "no"},
    }
    resources = template.resources
    if resources is not None:
        if resources.cpus is not None:
            host_config["NanoCpus"] = int(resources.cpus * 1e9)
        if resources.memory_bytes is not None:
            host_config["Memory"] = resources.memory_bytes
    if gpus:
        host_config["DeviceRequests"] = [device_request(tuple(gpus))]
    elif template.gpus is not None:
        host_config["DeviceRequests"] = [device_request(template.gpus)]
    if template.volumes:
        host_config["Binds"] = list(template.volumes)
    config: dict[str, Any] = {
        "Image": template.image,
        "Env": [f"{k}={v}" for k, v in env.items()],
        "Labels": {
            **labels,
            LABEL + "service": launch.service,
            LABEL + "revision": str(launch.revision),
            LABEL + "replica": launch.replica_id,
            **({LABEL + "gpus": ",".join(gpus)} if gpus else {}),
        },
        "ExposedPorts": {f"{port}/tcp": {}},
        "HostConfig": host_config,
    }
    if template.commands:
        config["Entrypoint"] = ["/bin/sh", "-c"]
        config["Cmd"] = [container_script(template.commands)]
    if template.user is not None:
        config["User"] = template.user
    return config


def device_request(gpus: int | str | Sequence[str]) -> dict[str, Any]:
    """The ``DeviceRequests`` entry of ``docker run --gpus``: a count (``all``: -1) or ids."""
    request: dict[str, Any] = {"Driver": "nvidia", "Capabilities": [["gpu"]]}
    if gpus == "all":
        request["Count"] = -1
    elif isinstance(gpus, int):
        request["Count"] = gpus
    else:
        request["DeviceIDs"] = list(gpus)
    return request


def container_script(commands: Sequence[str]) -> str:
    """The ``sh -c`` script of a container's commands: each runs if the one before succeeded;
    the last is ``exec``'d when it is a plain command (no ``;``, ``&``, ``|`` or newline), so
    the server gets the signals and its status is the container's."""
    parts = list(commands)
    last = parts[-1] if parts else ""
    words = last.split()
    if (
        words
        and not any(ch in last for ch in ";&|\n")
        and words[0] not in _SHELL_WORDS
        and "=" not in words[0]
        and words[0][0] not in "({!\"'$`\\"
    ):
        parts[-1] = f"exec {last}"
    return " && ".join(f"{{ {command}\n}}" for command in parts)


def signed_code(code: int | None) -> int | None:
    """Docker's ``128 + N`` for a process ended by signal N, as ``-N`` (the Exit convention;
    a process that exits with 143 of its own reads as SIGTERM too)."""
    if code is not None and 128 < code < 128 + 65:
        with contextlib.suppress(ValueError):
            return -signal.Signals(code - 128).value
    return code


LAST_LINE_MAX = 200


def exit_reason(stop_requested: bool, oom: bool, code: int | None, lines: Sequence[str]) -> str:
    """``stopped``, or why it ended on its own followed by its last output line:
    ``exited with code 3: fatal: model missing``."""
    if stop_requested:
        return "stopped (SIGKILL after the grace)" if code == 137 else "stopped"
    signed = signed_code(code)
    if oom:
        reason = "killed: out of memory"
    elif code is None:
        reason = "exited (exit status unknown: the container is gone)"
    elif signed is not None and signed < 0:
        reason = f"killed by signal {-signed} ({signal.Signals(-signed).name})"
    else:
        hint = {126: " (command not executable)", 127: " (command not found)"}.get(code, "")
        reason = f"exited with code {code}{hint}"
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    if last:
        cut = last if len(last) <= LAST_LINE_MAX else last[: LAST_LINE_MAX - 1] + "…"
        reason += f": {cut}"
    return reason
