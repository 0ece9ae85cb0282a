"""The Docker backend: ``engine`` (the Engine API client), ``placement`` (pure: which host),
``container`` (pure: a container's create body and exit reason), ``pulling`` (pure: pull
progress summed over layers), ``tunnel`` (an ssh:// engine's forwarded socket), ``hosts``
(the records of hosts and replicas), ``orphans`` (unknown containers swept), ``watch`` (one
engine's events followed, its reachability decided), ``backend`` (containers started,
stopped and adopted)."""

from .backend import DockerBackend, DockerHost, HostListener, HostState, PullListener
from .container import DEFAULT_CONTAINER_PORT, container_script
from .engine import EngineClient, EngineError, EngineTls, EngineUnreachable
from .placement import HostLoad, NoRoom, place
from .pulling import PullProgress
from .tunnel import SshOptions, Tunnel, ssh_command

__all__ = [
    "DEFAULT_CONTAINER_PORT",
    "DockerBackend",
    "DockerHost",
    "EngineClient",
    "EngineError",
    "EngineTls",
    "EngineUnreachable",
    "HostListener",
    "HostLoad",
    "HostState",
    "NoRoom",
    "PullListener",
    "PullProgress",
    "SshOptions",
    "Tunnel",
    "container_script",
    "place",
    "ssh_command",
]
