"""The data plane: a health-gated reverse proxy.

The control plane uses it only through the names below. They are imported on first use
(PEP 562): a worker process (``gateway.workers``) imports this package first, and must not
pay for what only the controller's process uses (the metrics' collectors and exposition, with
prometheus_client; the prober, the supervisor).

Each name is declared once, by the ``TYPE_CHECKING`` import of it below (``X as X``: PEP 484's
explicit re-export). Type checkers read those imports; at run time they never run, and
``__getattr__``, ``__dir__`` and ``__all__`` read them from this file on first use (as
scientific-python's ``lazy_loader`` reads a package's stub).

Importing it changes nothing in the process and gives the pure Python modules: a process
that runs the data plane compiled calls ``gateway.native.use()`` first (its entry point does).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import HEADER_NAME as HEADER_NAME
    from .config import WHITE_SPACE as WHITE_SPACE
    from .config import Address as Address
    from .config import AffinityKey as AffinityKey
    from .config import AuthRouting as AuthRouting
    from .config import Duration as Duration
    from .config import HeaderName as HeaderName
    from .config import Http2Config as Http2Config
    from .config import InferenceBalancing as InferenceBalancing
    from .config import LimitsConfig as LimitsConfig
    from .config import ListenAddress as ListenAddress
    from .config import ListenerLimits as ListenerLimits
    from .config import LoadBalancing as LoadBalancing
    from .config import LoadFactor as LoadFactor
    from .config import LoadMetricsConfig as LoadMetricsConfig
    from .config import ModelConfig as ModelConfig
    from .config import ModelsConfig as ModelsConfig
    from .config import OutlierConfig as OutlierConfig
    from .config import PositiveDuration as PositiveDuration
    from .config import PrefixChars as PrefixChars
    from .config import PreviewConfig as PreviewConfig
    from .config import ProbeConfig as ProbeConfig
    from .config import ProxyConfig as ProxyConfig
    from .config import RateLimit as RateLimit
    from .config import RequestKey as RequestKey
    from .config import RetriesConfig as RetriesConfig
    from .config import RouteConfig as RouteConfig
    from .config import ServiceRouting as ServiceRouting
    from .config import StickyConfig as StickyConfig
    from .config import TimeoutsConfig as TimeoutsConfig
    from .config import TlsConfig as TlsConfig
    from .config import TracingConfig as TracingConfig
    from .config import UpstreamProtocol as UpstreamProtocol
    from .config import UpstreamTlsConfig as UpstreamTlsConfig
    from .config import dump_settings as dump_settings
    from .config import parse_address as parse_address
    from .config import parse_duration as parse_duration
    from .config import parse_settings as parse_settings
    from .errors import GatewayError as GatewayError
    from .errors import NoRoutableUpstream as NoRoutableUpstream
    from .errors import UpstreamConnectError as UpstreamConnectError
    from .errors import UpstreamTimeout as UpstreamTimeout
    from .health.load_scraper import LoadScraper as LoadScraper
    from .health.prober import Prober as Prober
    from .listening import listen as listen
    from .listening import listening_socket as listening_socket
    from .listening import stop_accepting as stop_accepting
    from .observability.accesslog import AccessLog as AccessLog
    from .observability.exporter import SpanExporter as SpanExporter
    from .observability.metrics import GatewayMetrics as GatewayMetrics
    from .observability.scrape import AccessLogCollector as AccessLogCollector
    from .observability.scrape import ConnectionsCollector as ConnectionsCollector
    from .observability.scrape import Http2ConnectionsCollector as Http2ConnectionsCollector
    from .observability.scrape import LoadCollector as LoadCollector
    from .observability.scrape import MetricsCollector as MetricsCollector
    from .observability.scrape import TracingCollector as TracingCollector
    from .observability.scrape import metrics_exposition as metrics_exposition
    from .observability.spans import Span as Span
    from .pool.events import PoolEvent as PoolEvent
    from .pool.events import PoolSubscriber as PoolSubscriber
    from .pool.events import ProbeObserver as ProbeObserver
    from .pool.events import ProbeResult as ProbeResult
    from .pool.events import RequestObserver as RequestObserver
    from .pool.events import RequestRecord as RequestRecord
    from .pool.pool import Pool as Pool
    from .pool.service_pool import Lease as Lease
    from .pool.service_pool import ServicePool as ServicePool
    from .pool.snapshot import PoolSnapshot as PoolSnapshot
    from .pool.upstream import AdminState as AdminState
    from .pool.upstream import Health as Health
    from .pool.upstream import Upstream as Upstream
    from .proxy import Proxy as Proxy
    from .server import TrafficServer as TrafficServer
    from .tls import ReloadReport as ReloadReport
    from .tls import Termination as Termination
    from .tls.metrics import TlsCollector as TlsCollector
    from .wire.http1 import http_date as http_date
    from .wire.upstream_tls import UpstreamTlsError as UpstreamTlsError
    from .wire.upstream_tls import upstream_tls_context as upstream_tls_context
    from .workers.metrics import WorkersCollector as WorkersCollector
    from .workers.supervisor import Supervisor as Supervisor
    from .workers.supervisor import WorkerSettings as WorkerSettings


@functools.cache
def _exports() -> dict[str, str]:
    """Each public name -> its module, read from the ``TYPE_CHECKING`` imports above."""
    import ast

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If))
    return {
        alias.name: "." * node.level + (node.module or "")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def __getattr__(name: str) -> object:
    if name == "__all__":
        value: object = sorted(_exports())
    elif name in _exports():
        value = getattr(importlib.import_module(_exports()[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_exports()})
