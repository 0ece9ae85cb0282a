"""The data plane: a health-gated reverse proxy.

The control plane uses it only through the names below.
"""

from . import native

native.use(__path__)  # first: the compiled modules, if built from these sources (native.py)

from .config import (
    Duration,
    LimitsConfig,
    ListenerLimits,
    LoadBalancing,
    OutlierConfig,
    ProbeConfig,
    ProxyConfig,
    RetriesConfig,
    RouteConfig,
    ServiceRouting,
    TimeoutsConfig,
    parse_address,
    parse_duration,
)
from .errors import GatewayError, NoRoutableUpstream, UpstreamConnectError, UpstreamTimeout
from .events import (
    PoolEvent,
    PoolSubscriber,
    ProbeObserver,
    ProbeResult,
    RequestObserver,
    RequestRecord,
)
from .pool import Lease, Pool, PoolSnapshot, ServicePool
from .upstream import AdminState, Health, Upstream

__all__ = [
    "AdminState",
    "Duration",
    "GatewayError",
    "Health",
    "Lease",
    "LimitsConfig",
    "ListenerLimits",
    "LoadBalancing",
    "NoRoutableUpstream",
    "OutlierConfig",
    "Pool",
    "PoolEvent",
    "PoolSnapshot",
    "PoolSubscriber",
    "ProbeConfig",
    "ProbeObserver",
    "ProbeResult",
    "ProxyConfig",
    "RequestObserver",
    "RequestRecord",
    "RetriesConfig",
    "RouteConfig",
    "ServicePool",
    "ServiceRouting",
    "TimeoutsConfig",
    "Upstream",
    "UpstreamConnectError",
    "UpstreamTimeout",
    "parse_address",
    "parse_duration",
]
