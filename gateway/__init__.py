"""The data plane: a health-gated reverse proxy.

The control plane uses it only through the names below.
"""

from . import native

native.use(__path__)  # first: the compiled modules, if built from these sources (native.py)

from .accesslog import AccessLog
from .config import (
    Address,
    AuthRouting,
    Duration,
    LimitsConfig,
    ListenAddress,
    ListenerLimits,
    LoadBalancing,
    Model,
    OutlierConfig,
    PreviewConfig,
    ProbeConfig,
    ProxyConfig,
    RateLimit,
    RequestKey,
    RetriesConfig,
    RouteConfig,
    ServiceRouting,
    StickyConfig,
    TimeoutsConfig,
    TlsConfig,
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
from .metrics import GatewayMetrics, metrics_handler
from .pool import Pool
from .prober import Prober
from .proxy import Proxy
from .server import TrafficServer
from .service_pool import Lease, ServicePool
from .snapshot import PoolSnapshot
from .tls import ReloadReport, Termination
from .tls.metrics import register_tls
from .upstream import AdminState, Health, Upstream
from .workers.supervisor import Supervisor, WorkerSettings

__all__ = [
    "AccessLog",
    "Address",
    "AdminState",
    "AuthRouting",
    "Duration",
    "GatewayError",
    "GatewayMetrics",
    "Health",
    "Lease",
    "LimitsConfig",
    "ListenAddress",
    "ListenerLimits",
    "LoadBalancing",
    "Model",
    "NoRoutableUpstream",
    "OutlierConfig",
    "Pool",
    "PoolEvent",
    "PoolSnapshot",
    "PoolSubscriber",
    "PreviewConfig",
    "ProbeConfig",
    "ProbeObserver",
    "ProbeResult",
    "Prober",
    "Proxy",
    "ProxyConfig",
    "RateLimit",
    "ReloadReport",
    "RequestKey",
    "RequestObserver",
    "RequestRecord",
    "RetriesConfig",
    "RouteConfig",
    "ServicePool",
    "ServiceRouting",
    "StickyConfig",
    "Supervisor",
    "Termination",
    "TimeoutsConfig",
    "TlsConfig",
    "TrafficServer",
    "Upstream",
    "UpstreamConnectError",
    "UpstreamTimeout",
    "WorkerSettings",
    "metrics_handler",
    "parse_address",
    "parse_duration",
    "register_tls",
]
