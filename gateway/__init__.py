"""The data plane: a health-gated reverse proxy.

The control plane uses it only through the names below. They are imported on first use
(PEP 562): a worker process (``gateway.workers``) imports this package first, and must not
pay for what only the controller's process uses (the metrics' collectors and exposition, with
prometheus_client; the prober, the supervisor).

Importing it changes nothing in the process and gives the pure Python modules: a process
that runs the data plane compiled calls ``gateway.native.use()`` first (its entry point does).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .accesslog import AccessLog
    from .config import (
        Address,
        AuthRouting,
        Duration,
        LimitsConfig,
        ListenAddress,
        ListenerLimits,
        LoadBalancing,
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
        dump_settings,
        parse_address,
        parse_duration,
        parse_settings,
    )
    from .errors import (
        GatewayError,
        NoRoutableUpstream,
        UpstreamConnectError,
        UpstreamTimeout,
    )
    from .events import (
        PoolEvent,
        PoolSubscriber,
        ProbeObserver,
        ProbeResult,
        RequestObserver,
        RequestRecord,
    )
    from .listening import listen, listening_socket
    from .metrics import GatewayMetrics
    from .pool import Pool
    from .prober import Prober
    from .proxy import Proxy
    from .scrape import (
        AccessLogCollector,
        ConnectionsCollector,
        MetricsCollector,
        WorkersCollector,
        metrics_exposition,
    )
    from .server import TrafficServer
    from .service_pool import (
        Lease,
        ServicePool,
    )
    from .snapshot import PoolSnapshot
    from .tls import (
        ReloadReport,
        Termination,
    )
    from .tls.metrics import TlsCollector
    from .upstream import (
        AdminState,
        Health,
        Upstream,
    )
    from .wire.http1 import http_date
    from .workers.supervisor import (
        Supervisor,
        WorkerSettings,
    )

_WHERE: dict[str, str] = {
    "AccessLog": ".accesslog",
    "AccessLogCollector": ".scrape",
    "Address": ".config",
    "AdminState": ".upstream",
    "AuthRouting": ".config",
    "Duration": ".config",
    "GatewayError": ".errors",
    "GatewayMetrics": ".metrics",
    "Health": ".upstream",
    "Lease": ".service_pool",
    "LimitsConfig": ".config",
    "ListenAddress": ".config",
    "ListenerLimits": ".config",
    "LoadBalancing": ".config",
    "MetricsCollector": ".scrape",
    "NoRoutableUpstream": ".errors",
    "OutlierConfig": ".config",
    "Pool": ".pool",
    "PoolEvent": ".events",
    "PoolSnapshot": ".snapshot",
    "PoolSubscriber": ".events",
    "PreviewConfig": ".config",
    "ProbeConfig": ".config",
    "ProbeObserver": ".events",
    "ProbeResult": ".events",
    "Prober": ".prober",
    "Proxy": ".proxy",
    "ProxyConfig": ".config",
    "RateLimit": ".config",
    "ReloadReport": ".tls",
    "RequestKey": ".config",
    "RequestObserver": ".events",
    "RequestRecord": ".events",
    "RetriesConfig": ".config",
    "RouteConfig": ".config",
    "ServicePool": ".service_pool",
    "ServiceRouting": ".config",
    "StickyConfig": ".config",
    "Supervisor": ".workers.supervisor",
    "Termination": ".tls",
    "TimeoutsConfig": ".config",
    "TlsCollector": ".tls.metrics",
    "TlsConfig": ".config",
    "TrafficServer": ".server",
    "listen": ".listening",
    "listening_socket": ".listening",
    "http_date": ".wire.http1",
    "Upstream": ".upstream",
    "UpstreamConnectError": ".errors",
    "UpstreamTimeout": ".errors",
    "WorkerSettings": ".workers.supervisor",
    "WorkersCollector": ".scrape",
    "metrics_exposition": ".scrape",
    "ConnectionsCollector": ".scrape",
    "dump_settings": ".config",
    "parse_address": ".config",
    "parse_duration": ".config",
    "parse_settings": ".config",
}
"""Each public name -> the module that defines it."""


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AccessLog",
    "AccessLogCollector",
    "Address",
    "AdminState",
    "AuthRouting",
    "ConnectionsCollector",
    "Duration",
    "GatewayError",
    "GatewayMetrics",
    "Health",
    "Lease",
    "LimitsConfig",
    "ListenAddress",
    "ListenerLimits",
    "LoadBalancing",
    "MetricsCollector",
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
    "TlsCollector",
    "TlsConfig",
    "TrafficServer",
    "Upstream",
    "UpstreamConnectError",
    "UpstreamTimeout",
    "WorkerSettings",
    "WorkersCollector",
    "dump_settings",
    "http_date",
    "listen",
    "listening_socket",
    "metrics_exposition",
    "parse_address",
    "parse_duration",
    "parse_settings",
]
