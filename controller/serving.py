"""The composition root: config, store, backends, pool, prober, proxy, apps, uvloop, signals.

``gateway serve -c FILE`` builds both halves on one event loop in this order and stops them
in reverse: the traffic listener stops accepting first and lets in-flight requests finish,
then the admin listener, the prober and the controller go (replicas are left running for the
next start to adopt, unless ``replicas_on_exit: stop``). Before any of it, the state directory
is locked and the listeners are bound (``StateLock``, ``bind``): a second gateway beside a
running one stops there, having touched nothing of it.

The store is the state; the config's ``services`` are intents. At start-up the stored services
come back first; then each config entry is applied only if its document changed since it was
last applied from the config (or never was), so what the API changed since stands
(``startup_choice``). Each service's log line says which source won.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence, Set
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from prometheus_client.registry import CollectorRegistry

from gateway import (
    ConnectionsCollector,
    GatewayMetrics,
    Http2ConnectionsCollector,
    LoadCollector,
    LoadScraper,
    MetricsCollector,
    Pool,
    ProbeObserver,
    Prober,
    RequestObserver,
    Supervisor,
    WorkersCollector,
    WorkerSettings,
    listening_socket,
    metrics_exposition,
    native,
    parse_address,
)

from .acme import AcmeManager
from .acme.manager import controller_routes
from .admin.app import AdminServer, build_admin_app
from .admin.cluster import cluster_logs, cluster_middleware, cluster_operations
from .admin.handlers import LOGS_ELSEWHERE
from .admin.tls import tls_operations
from .admin.views import certificates_operation
from .backends import ProcessBackend, StaticBackend
from .backends.base import Backend
from .config import ConfigService, GatewayConfig, LoadedConfig
from .errors import ControllerError, ListenFailed, StoreUnavailable
from .journal import Journal
from .metrics import DockerHostMetrics, HostJournal, register_acme, register_docker
from .metrics import register as register_controller_metrics
from .operations import Controller
from .rollout_traces import RolloutTraces
from .statelock import StateLock
from .store import ConfigAppliedRow, Store

if TYPE_CHECKING:  # imported where used: most gateways run no Docker backend
    from .backends.docker import DockerBackend

if TYPE_CHECKING:  # the data plane and TLS, imported where used: with workers, the main
    # process serves no traffic; without listen_tls, it loads no TLS (``main.serve_main``)
    from gateway import AccessLog, ReloadReport, SpanExporter, Termination, TrafficServer

if TYPE_CHECKING:
    from .cluster.engines import Engines
    from .etcd import EtcdClient
    from .node import ClusterNode
    from .store.etcd import EtcdStore

log = logging.getLogger("gateway")


@dataclass
class Gateway:
    """A running gateway, for tests: its ports, controller and pool."""

    controller: Controller
    pool: Pool
    traffic: TrafficServer | Supervisor
    admin: AdminServer
    acme: AcmeManager | None = None
    tls: Termination | None = None
    reload_tls: Callable[[], ReloadReport | None] | None = None


StoredAs = Literal["live", "deleted", "absent"]


@dataclass(frozen=True, slots=True)
class StartupChoice:
    """Whether a config entry is applied at start-up, and the log line that says why."""

    apply: bool
    reason: str


def startup_choice(
    entry: ConfigService, last: ConfigAppliedRow | None, stored: StoredAs
) -> StartupChoice:
    """Which source wins for one service of the config: its entry, or the store.

    1. Never applied from the config (a new service, a fresh store, a service the API made
       that the config now names): the entry is applied.
    2. The entry's document changed since it was last applied: applied (an edit of the file is
       a new intent).
    3. Unchanged: not applied. The stored spec stands, with whatever the API changed since,
       and a service deleted through the API stays deleted.
    """
    name, source = entry.spec.name, entry.source
    if last is None:
        if stored == "live":
            return StartupChoice(
                True, f"{name}: {source} never applied from the config before: applied"
            )
        return StartupChoice(True, f"{name}: created from {source}")
    if last.digest != entry.digest:
        return StartupChoice(True, f"{name}: {source} changed since last applied: applied")
    if stored == "live":
        return StartupChoice(
            False, f"{name}: spec from the store ({source} unchanged since last applied)"
        )
    return StartupChoice(
        False,
        f"{name}: deleted through the API since {source} was last applied: not created again"
        " (edit the file or apply it to bring it back)",
    )


def config_differences(
    entries: Sequence[ConfigService], applied: Sequence[ConfigAppliedRow], live: Set[str]
) -> list[str]:
    """How a node's config ``services`` differ from what the cluster applied from configs
    (``applied``: the ``config_applied`` rows; ``live``: the live services), one line each, in
    the config's order then by name; empty when they agree.

    1. A cluster that never applied a config's service (a new one: the first node to lead
       applies its own) has nothing to differ from.
    2. An entry never applied in the cluster, or whose document differs from the one last
       applied (the digests): named with the cluster's source.
    3. A live service the cluster applied from a config that this config does not name.
    Services made through the API only, and deleted ones not named, are no difference.
    """
    if not applied:
        return []
    last = {row.service: row for row in applied}
    lines = []
    for entry in entries:
        name = entry.spec.name
        row = last.pop(name, None)
        if row is None:
            lines.append(f"{name}: in this config ({entry.source}), never applied in the cluster")
        elif row.digest != entry.digest:
            lines.append(
                f"{name}: {entry.source} differs from the document the cluster applied"
                f" (from {row.source})"
            )
    for name, row in sorted(last.items()):
        if name in live:
            lines.append(f"{name}: applied in the cluster (from {row.source}), not in this config")
    return lines


async def tell_config_differences(
    store: EtcdStore, entries: Sequence[ConfigService], node: str
) -> list[str]:
    """At a node's start: warn, naming each (``config_differences``), when its config's
    ``services`` differ from what the cluster applied. Only the node that leads applies its
    config's services, when its term begins; this node applies its differences then, if ever."""
    try:
        applied, live = await store.applied_config()
    except StoreUnavailable as e:
        log.warning("node %s: config services not compared with the cluster's: %s", node, e)
        return []
    lines = config_differences(entries, applied, live)
    if lines:
        log.warning(
            "node %s: this config's services differ from what the cluster applied (only the"
            " node that leads applies its config's services, when its term begins: keep every"
            " node's services: the same):\n  %s",
            node,
            "\n  ".join(lines),
        )
    return lines


async def apply_config_services(
    controller: Controller, store: Store, entries: tuple[ConfigService, ...]
) -> None:
    """Apply the config's entries that win over the store (``startup_choice``), and log for
    each service which source won. Runs after ``Controller.restore``."""
    for entry in entries:
        name = entry.spec.name
        try:
            row = store.service(name, include_deleted=True)
            stored: StoredAs = "absent" if row is None else "deleted" if row.deleted else "live"
            choice = startup_choice(entry, store.config_applied(name), stored)
            if not choice.apply:
                reason = choice.reason
                if stored == "live" and controller.plan_apply(entry.spec).action != "unchanged":
                    reason = (
                        f"{name}: spec from the store (changed through the API since"
                        f" {entry.source} was last applied)"
                    )
                log.info("%s", reason)
                continue
            with controller.applying("config", entry.source) as span:
                result = await controller.apply(entry.spec, span)
            store.record_config_applied(name, entry.source, entry.digest)
            log.info("%s (%s, revision %s)", choice.reason, result.action, result.revision)
        except ControllerError as e:
            log.error("service %s from %s not applied: %s", name, entry.source, e.message)


async def run_gateway(
    loaded: LoadedConfig,
    stop: asyncio.Event,
    started: Callable[[Gateway], Awaitable[None] | None] | None = None,
    at_once: list[Callable[[], None]] | None = None,
) -> None:
    """Run until ``stop`` is set, then shut down in order. The trigger is injectable.
    ``at_once`` gets what must still be done if the process exits without that order (a
    second signal): with ``replicas_on_exit: stop``, SIGKILL to the local replicas.

    First the state directory's lock (``StateLock``), then the listeners are bound: a second
    gateway on the same directory or addresses raises ``StartRefused`` having opened no store
    and started, adopted or stopped no replica."""
    state_dir = Path(loaded.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before serving
    with StateLock.take(state_dir), contextlib.ExitStack() as bound:
        await _run_locked(loaded, stop, started, at_once, state_dir, bound)


async def _run_locked(
    loaded: LoadedConfig,
    stop: asyncio.Event,
    started: Callable[[Gateway], Awaitable[None] | None] | None,
    at_once: list[Callable[[], None]] | None,
    state_dir: Path,
    bound: contextlib.ExitStack,
) -> None:
    """``run_gateway`` under the lock. ``bound`` closes the listening sockets if start-up
    fails before they are served."""
    config = loaded.config
    loop = asyncio.get_running_loop()
    pool = Pool(clock=loop.time)
    # -- observability: metrics on one registry (served at the admin /metrics), access log --
    registry = CollectorRegistry()
    metrics = GatewayMetrics()
    metrics.attach(pool)
    registry.register(MetricsCollector(metrics))
    # -- HTTPS: certificates from files and from ACME, served by the TLS listeners --
    proxy_config = config.proxy_config()
    if config.tls.acme is not None:  # what ACME obtains is loaded from here
        managed = str(state_dir / "acme" / "certificates")
        tls_config = replace(proxy_config.tls, managed_dir=managed)
        proxy_config = replace(proxy_config, tls=tls_config)
    tls: Termination | None = None
    if proxy_config.listen_tls:
        from gateway import Termination, TlsCollector

        tls = Termination(proxy_config.tls)
        registry.register(TlsCollector(tls))
    request_observers: list[RequestObserver] = [metrics]
    access_log: AccessLog | None = None
    workers = config.worker_count
    if config.access_log.enabled and workers == 1:
        from gateway import AccessLog, AccessLogCollector

        access_log = AccessLog(config.access_log.format, config.access_log.path)
        registry.register(AccessLogCollector(access_log))
        request_observers.append(access_log)
    exporter: SpanExporter | None = None
    if config.tracing.otlp_endpoint is not None:  # spans of the sampled requests
        from gateway import SpanExporter, TracingCollector

        exporter = SpanExporter(config.tracing)
        registry.register(TracingCollector(exporter))
    traffic: TrafficServer | Supervisor
    if workers == 1:
        from gateway import Proxy, TrafficServer

        proxy = Proxy(
            pool,
            proxy_config,
            observers=request_observers,
            spans=exporter.buffer if exporter is not None else None,
        )
        traffic = TrafficServer(proxy, proxy_config, tls=tls)
    else:
        settings = WorkerSettings(
            count=workers,
            access_log=(config.access_log.format, config.access_log.path)
            if config.access_log.enabled
            else None,
            log_level=config.log_level,
        )
        traffic = Supervisor(
            pool,
            proxy_config,
            settings,
            metrics=metrics,
            tls=tls,
            spans=exporter.buffer if exporter is not None else None,
        )
        registry.register(WorkersCollector(traffic))
    # -- listeners: bound (connections queue, and are accepted once serving starts) before
    # the store is opened or any replica adopted, swept or started: a second gateway on
    # these addresses stops here, having touched nothing --
    admin_host, admin_port = parse_address(config.admin.listen, listen=True)
    try:
        bound.callback(traffic.unbind)
        traffic.bind()
        admin_socket = listening_socket(admin_host, admin_port, False)
    except OSError as e:
        raise ListenFailed(e.strerror or str(e)) from e
    if admin_socket is not None:
        bound.callback(admin_socket.close)  # a no-op once served: the server closed it
    # -- the state --
    etcd = config.state.etcd if config.state.store == "etcd" else None
    client: EtcdClient | None = None
    store: Store
    if etcd is None:
        store = Store(state_dir / "gateway.db")
    else:  # a cluster (opt-in: its modules are imported only then)
        from .cluster.connect import connect
        from .store.etcd import EtcdStore

        client = connect(etcd)
        store = EtcdStore(client, etcd.prefix, time.time)
    journal = Journal(store, time.time)
    process = config.backends.process
    local = ProcessBackend(
        capacity=process.capacity,
        port_range=process.ports,
        log_dir=state_dir / "logs",
        log_max_bytes=process.log_max_bytes,
        host="127.0.0.1" if etcd is None else config.node.host(config.admin.listen),
    )
    if at_once is not None and config.replicas_on_exit == "stop":
        at_once.append(local.kill_all)
    process_backend: Backend = local
    if client is not None and etcd is not None:
        from .node import idle_backend

        # The leader places process replicas on the nodes, whose agents run them with
        # ``local``: ``ClusterNode`` puts its backend here for each term.
        process_backend = idle_backend(client, etcd.prefix)
    backends: dict[str, Backend] = {"process": process_backend, "static": StaticBackend()}
    docker: DockerBackend | None = None
    engines: Engines | None = None
    if config.backends.docker is not None:  # opt-in: the embedded default is process only

        def say_pull(service: str, line: str) -> None:
            # A pull's progress, a line every 2 s, among the service's events.
            journal.record(service, "image_pulling", line)

        if client is None or etcd is None:
            docker = docker_backend(config, instance_id(state_dir))
            docker.pull_listeners.append(say_pull)
            backends["docker"] = docker
        else:  # the leader talks to every engine, each term with a backend of its own
            from .cluster.engines import Engines

            def make_docker(instance: str) -> DockerBackend:
                made = docker_backend(config, instance, config.node.name)
                made.pull_listeners.append(say_pull)
                made.host_listeners.append(HostJournal(journal))
                return made

            engines = Engines(client, etcd.prefix, make_docker)
            backends["docker"] = process_backend  # places nothing until the node leads
    controller = Controller(pool, backends, store, journal, loop.time, time.time)
    traces: RolloutTraces | None = None
    if exporter is not None:  # each rollout a trace: its apply, steps, replicas' starts
        traces = RolloutTraces(exporter.buffer.add, controller.active_rollout, time.time)
        journal.listen(traces)
        controller.traces = traces
        controller.executor.on_launch = traces.launching
    register_controller_metrics(registry, controller)
    if docker is not None:
        register_docker(registry, controller, docker)
    if engines is not None:
        registry.register(DockerHostMetrics(engines.current))

    def reload_tls() -> ReloadReport | None:
        """Load the certificate files that changed, here and in every worker."""
        if tls is None:
            return None
        report = tls.reload()
        if isinstance(traffic, Supervisor):
            traffic.reload_tls()
        return report

    async def certificates_changed() -> None:
        reload_tls()

    acme: AcmeManager | None = None
    if config.tls.acme is not None:  # certificates of the routes' hosts, by ACME HTTP-01
        acme = AcmeManager(
            config.tls.acme,
            state_dir,
            controller_routes(controller),
            journal,
            on_certificates=certificates_changed,
        )
        register_acme(registry, acme)
    probe_observers: list[ProbeObserver] = [metrics, controller.reconciler]
    if traces is not None:
        probe_observers.append(traces)
    prober = Prober(pool, observers=probe_observers)
    scraper = LoadScraper(
        pool, on_scraped=traffic.send_loads if isinstance(traffic, Supervisor) else None
    )
    registry.register(LoadCollector(scraper, pool, loop.time))
    served = traffic
    registry.register(ConnectionsCollector(lambda: (served.connections, served.parked)))
    registry.register(Http2ConnectionsCollector(lambda: served.http2))
    ready = False
    node: ClusterNode | None = None
    middlewares = []
    if client is not None and etcd is not None:
        from .node import ClusterNode
        from .store.etcd import EtcdStore

        assert isinstance(store, EtcdStore)

        async def apply_config() -> None:
            await apply_config_services(controller, store, loaded.services)

        host = config.node.host(config.admin.listen)
        node = ClusterNode(
            etcd=etcd,
            node=config.node,
            address=f"http://{host}:{admin_port}",
            listen=(config.listen, *config.listen_tls),
            client=client,
            store=store,
            pool=pool,
            controller=controller,
            journal=journal,
            local=local,
            apply_config=apply_config,
            engines=engines,
        )
        middlewares.append(cluster_middleware(node, node.session))
        from .node_metrics import register_node

        register_node(registry, node)
    admin_app = build_admin_app(
        controller,
        lambda: ready,
        config.admin_token(),
        metrics=metrics_exposition(registry),
        extra_routes=[
            certificates_operation(acme),
            *tls_operations(tls, reload_tls),
            *cluster_operations(node),
        ],
        middlewares=middlewares,
    )
    if node is not None:  # a replica's log is on the node that runs it
        admin_app[LOGS_ELSEWHERE] = cluster_logs(node, node.session)
    admin = AdminServer(admin_app, config.admin.listen, sock=admin_socket)

    await prober.start()
    await scraper.start()
    try:
        if docker is not None:
            await docker.connect()  # each engine's containers are known before adoption
        if node is None:
            controller.restore()
            await local.sweep()  # replicas left with no record to adopt them by
            await apply_config_services(controller, store, loaded.services)
        else:  # the node that leads restores and applies (``ClusterNode``)
            assert isinstance(store, EtcdStore)
            await tell_config_differences(store, loaded.services, node.name)
            await node.start()  # its agent has adopted this node's replicas
            if node.agent.loaded.is_set():
                await local.sweep()
        if access_log is not None:
            access_log.start()
        if exporter is not None:
            exporter.start()
        await traffic.start()
        if acme is not None:  # after the plain listener, which answers its challenges
            await acme.start()
        await admin.start()
        if tls is not None:  # SIGHUP: load the certificate files that changed
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_tls)
        # What start-up built lives as long as the process: move it out of the cyclic
        # collector's sight, so each collection scans only what traffic allocates.
        gc.collect()
        gc.freeze()
        ready = True
        log.info("gateway ready: traffic on %s, admin on %s", config.listen, config.admin.listen)
        log.info("data plane: %s", native.running)
        if started is not None:
            pending = started(Gateway(controller, pool, traffic, admin, acme, tls, reload_tls))
            if pending is not None:
                await pending
        await stop.wait()
        log.info("shutting down: finishing in-flight requests")
    finally:
        ready = False
        if tls is not None:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if acme is not None:
            await acme.stop()
        await traffic.stop()
        if access_log is not None:
            await access_log.stop()
        if exporter is not None:  # after the traffic: the spans of the last requests go too
            await exporter.stop()
        await admin.stop()
        await scraper.stop()
        await prober.stop()
        if node is not None:
            # Replicas stay on their nodes: a node back within its lease TTL keeps its own.
            await node.stop(keep_replicas=config.replicas_on_exit == "keep")
        await controller.close(stop_replicas=node is None and config.replicas_on_exit == "stop")
        if client is not None:
            await client.close()
        store.close()
        log.info("gateway stopped")


def instance_id(state_dir: Path) -> str:
    """This gateway's id (``<state_dir>/instance-id``, made at first start): the label that
    tells its containers from another gateway's on a shared engine."""
    path = state_dir / "instance-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        value = uuid.uuid4().hex
        path.write_text(value + "\n")
        return value


def docker_backend(config: GatewayConfig, instance: str, node: str | None = None) -> DockerBackend:
    """The Docker backend of ``config``'s hosts; ``node``: the cluster node talking to them."""
    from .backends.docker import DockerBackend, DockerHost, EngineTls, SshOptions

    assert config.backends.docker is not None
    hosts = [
        DockerHost(
            h.name,
            h.engine,
            h.address,
            h.capacity.replicas,
            h.ports,
            gpus=h.capacity.devices,
            gpu_ids=h.capacity.gpu_ids,
            tls=None if h.tls is None else EngineTls(**h.tls.model_dump()),
            ssh=None if h.ssh is None else SshOptions(**h.ssh.model_dump()),
        )
        for h in config.backends.docker.hosts
    ]
    return DockerBackend(
        hosts, instance, orphan_grace=config.backends.docker.orphan_grace, node=node
    )


def _install_signals(stop: asyncio.Event, at_once: list[Callable[[], None]]) -> None:
    """SIGTERM or SIGINT: shut down in order (``stop``). A second one: exit at once, after
    ``at_once`` (the replicas killed rather than left running on their ports)."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second signal: exiting at once")
            for do in at_once:
                try:
                    do()
                except Exception:
                    log.exception("at exit: %r failed", do)
            os._exit(1)
        log.info("signal %s: stopping", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


async def serve(loaded: LoadedConfig) -> None:
    """Run the gateway of ``loaded`` until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    at_once: list[Callable[[], None]] = []
    _install_signals(stop, at_once)
    await run_gateway(loaded, stop, at_once=at_once)
