"""The Docker backend: ``engine`` (the Engine API client), ``placement`` (pure: which host),
``backend`` (containers started, stopped, watched and adopted)."""

from .backend import DEFAULT_CONTAINER_PORT, DockerBackend, DockerHost, container_script
from .engine import EngineClient, EngineError, EngineUnreachable
from .placement import HostLoad, NoRoom, place

__all__ = [
    "DEFAULT_CONTAINER_PORT",
    "DockerBackend",
    "DockerHost",
    "EngineClient",
    "EngineError",
    "EngineUnreachable",
    "HostLoad",
    "NoRoom",
    "container_script",
    "place",
]
