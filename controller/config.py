"""The gateway config file and its one loader.

Nothing else in the project reads YAML files or the environment for settings. A bad file
stops start-up with ``ConfigError``: one message naming the file, each field path and the
reason, and no traceback. Relative paths (``state_dir``, the files under ``services``, a
spec's relative ``working_dir``) are taken relative to the file that names them.

Each entry of ``services`` comes with the digest of its document (``document_digest``): the
start-up applies an entry only when that changed since the entry was last applied
(``controller.serving``), so a restart does not undo what the API changed since.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from gateway import (
    Duration,
    Http2Config,
    ListenAddress,
    ListenerLimits,
    ModelsConfig,
    ProxyConfig,
    TlsConfig,
    TracingConfig,
)

from . import documents
from .cluster.config import NodeConfig, StateConfig
from .errors import DocumentError, DocumentTooLarge
from .schema import Model
from .spec import GPU_ID_PATTERN, NAME_PATTERN, ServiceSpec, model_clash


class ConfigError(Exception):
    """A config or spec file that cannot be used; ``str()`` is the message for the user."""


class AdminConfig(Model):
    listen: ListenAddress = "127.0.0.1:8081"
    token_env: str | None = "GATEWAY_ADMIN_TOKEN"
    """The environment variable that holds the bearer token."""
    token_file: str | None = None
    """Or a file whose content (stripped) is the token."""


def _port_range(value: str) -> str:
    low, sep, high = value.partition("-")
    if (
        not sep
        or not low.isascii()
        or not low.isdigit()
        or not high.isascii()
        or not high.isdigit()
    ):
        raise ValueError("must be LOW-HIGH, e.g. 20000-20999")
    if not 1 <= int(low) <= int(high) <= 65535:
        raise ValueError("ports must satisfy 1 <= LOW <= HIGH <= 65535")
    return value


def _ports(value: str) -> tuple[int, int]:
    low, _, high = value.partition("-")
    return int(low), int(high)


class ProcessBackendConfig(Model):
    capacity: int | None = Field(default=8, ge=0)
    """Most replicas at once; a start beyond it fails with no capacity."""
    port_range: str = "20000-20999"
    log_max_bytes: int = Field(default=1024 * 1024, ge=1024)

    _range = field_validator("port_range")(_port_range)

    @property
    def ports(self) -> tuple[int, int]:
        return _ports(self.port_range)


class DockerCapacity(Model):
    replicas: int = Field(default=8, ge=0)
    """Most replicas on the host at once; beyond it placement looks elsewhere."""
    gpus: int = Field(default=0, ge=0, le=1024)
    """GPUs for replicas that ask for some (``replica.gpus``); 0: none is placed here."""
    gpu_ids: tuple[Annotated[str, Field(pattern=GPU_ID_PATTERN)], ...] = Field(
        default=(), max_length=1024
    )
    """Their device ids (UUIDs, say); empty: the indexes ``0`` to ``gpus - 1``."""

    @model_validator(mode="after")
    def _ids_counted(self) -> DockerCapacity:
        if self.gpu_ids and self.gpus not in (0, len(self.gpu_ids)):
            raise ValueError(f"gpus: {self.gpus}, but {len(self.gpu_ids)} gpu_ids")
        if len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise ValueError("gpu_ids: a device id is listed twice")
        return self

    @property
    def devices(self) -> int:
        """How many GPUs the host has."""
        return len(self.gpu_ids) or self.gpus


def _absolute_file(value: str) -> str:
    if not Path(value).is_absolute():
        raise ValueError("must be an absolute path")
    if not Path(value).is_file():
        raise ValueError(f"no such file: {value}")
    return value


class DockerTls(Model):
    """A ``tcp://`` engine's TLS, as Docker's ``--tlsverify``: the engine's certificate is
    verified against ``ca_file`` (and the engine's host name), the gateway shows its own."""

    ca_file: str
    cert_file: str
    """The client certificate (PEM) the engine verifies against its ``--tlscacert``."""
    key_file: str

    _files = field_validator("ca_file", "cert_file", "key_file")(_absolute_file)


class DockerSsh(Model):
    """How the gateway reaches an ``ssh://`` engine (its socket forwarded by ``ssh -L``)."""

    identity_file: str | None = None
    """The private key (absolute path); by default ssh's own keys or agent."""
    known_hosts_file: str | None = None
    """Where the host's key is checked (absolute path); by default ssh's ``known_hosts``."""
    socket: str = Field(default="/var/run/docker.sock", pattern=r"^/[^\x00]*$")
    """The engine's socket on the remote host."""

    @field_validator("identity_file", "known_hosts_file")
    @classmethod
    def _file(cls, value: str | None) -> str | None:
        return None if value is None else _absolute_file(value)


class DockerHostConfig(Model):
    """One Docker Engine that runs replicas."""

    name: str = Field(pattern=NAME_PATTERN)
    """What reasons, logs and the container labels call the host."""
    engine: str = "unix:///var/run/docker.sock"
    """``unix:///PATH``; ``tcp://HOST:PORT`` with ``tls`` (port 2376 by custom), or plain
    HTTP without it (a trusted network only: the engine's API is root on the host); or
    ``ssh://USER@HOST[:PORT]`` (the remote socket forwarded by an ``ssh`` child)."""
    tls: DockerTls | None = None
    ssh: DockerSsh | None = None
    """An ``ssh://USER@HOST[:PORT]`` engine's key, known hosts and remote socket."""
    address: str = "127.0.0.1"
    """The host's address the replicas' ports are published on, and the gateway connects to."""
    capacity: DockerCapacity = DockerCapacity()
    port_range: str = "21000-21999"
    """Host ports the backend gives replicas, one each."""

    _range = field_validator("port_range")(_port_range)

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str) -> str:
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme == "unix" and parts.path.startswith("/") and not parts.netloc:
            return value
        if parts.scheme == "tcp" and parts.hostname and port and parts.path in ("", "/"):
            return value
        if (
            parts.scheme == "ssh"
            and parts.hostname
            and parts.path in ("", "/")
            and not parts.query
            and not parts.password
        ):
            if port is not None or ":" not in parts.netloc.rpartition("@")[2]:
                return value
        raise ValueError("must be unix:///PATH, tcp://HOST:PORT or ssh://[USER@]HOST[:PORT]")

    @model_validator(mode="after")
    def _tls_over_tcp(self) -> DockerHostConfig:
        if self.tls is not None and not self.engine.startswith("tcp://"):
            raise ValueError("tls: only for a tcp:// engine")
        if self.ssh is not None and not self.engine.startswith("ssh://"):
            raise ValueError("ssh: only for an ssh:// engine")
        return self

    @property
    def ports(self) -> tuple[int, int]:
        return _ports(self.port_range)


class DockerBackendConfig(Model):
    """The docker backend: off unless configured."""

    hosts: tuple[DockerHostConfig, ...] = Field(min_length=1)
    orphan_grace: Duration = 60.0
    """How long after start-up (and after a host answers again) a container labelled with this
    gateway's instance that it neither started nor adopted is left before it is removed."""

    @field_validator("hosts")
    @classmethod
    def _unique(cls, hosts: tuple[DockerHostConfig, ...]) -> tuple[DockerHostConfig, ...]:
        names = [h.name for h in hosts]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"host {name!r} is listed more than once")
        return hosts


class BackendsConfig(Model):
    process: ProcessBackendConfig = ProcessBackendConfig()
    docker: DockerBackendConfig | None = None
    """Containers on Docker Engines (``backend: docker`` in a spec); off by default."""


class ProxyOptions(Model):
    limits: ListenerLimits = ListenerLimits()
    http2: Http2Config = Http2Config()
    """Inbound HTTP/2 (h2c by prior knowledge, h2 by ALPN: ``tls.alpn``)."""
    shutdown_timeout: Duration = 30.0
    upstream_keepalive: int = Field(default=256, ge=0)
    trust_forwarded: bool = False


class AccessLogConfig(Model):
    enabled: bool = True
    format: Literal["plain", "json"] = "plain"
    """``plain``, or ``json`` (one JSON object a line)."""
    path: str | None = None
    """A file; by default standard output."""


class AcmeConfig(Model):
    """Certificates obtained and renewed with ACME (RFC 8555), by the HTTP-01 challenge."""

    directory: str = "https://acme-v02.api.letsencrypt.org/directory"
    """The ACME server's directory URL (Let's Encrypt by default)."""
    email: str | None = None
    """The account's contact address, for the CA's expiry and policy mail."""
    ca_bundle: str | None = None
    """A CA file (an absolute path) to trust the directory's HTTPS with, instead of the
    system's (a private CA, pebble in tests)."""
    all_routes: bool = False
    """Obtain certificates for the exact hosts of every route, not only of routes with
    ``tls: acme``."""
    renew_at: float = Field(default=2 / 3, gt=0, lt=1)
    """Renew once this fraction of a certificate's lifetime has passed (with jitter)."""
    retry_min: Duration = Field(default=60.0, gt=0)
    retry_max: Duration = 3600.0
    """A failed order is retried after ``retry_min``, doubling up to ``retry_max``."""
    order_timeout: Duration = Field(default=90.0, gt=0)
    """How long one order may take, from its creation to the certificate's download (the
    CA's validation included), before it counts as failed."""

    @field_validator("directory")
    @classmethod
    def _directory(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        return url

    @field_validator("ca_bundle")
    @classmethod
    def _ca_bundle(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_absolute():
            raise ValueError(f"must be an absolute path: {path!r}")
        return path

    @field_validator("retry_max")
    @classmethod
    def _retry_max(cls, value: float, info: ValidationInfo) -> float:
        least = info.data.get("retry_min")
        if least is not None and value < least:
            raise ValueError(f"must be at least retry_min ({least:g}s)")
        return value


@dataclass(frozen=True, slots=True)
class GatewayTls(TlsConfig):
    acme: AcmeConfig | None = None
    """Automatic certificates; off unless configured."""


class GatewayConfig(Model):
    listen: ListenAddress = "0.0.0.0:8080"
    listen_tls: tuple[ListenAddress, ...] = ()
    """HTTPS listeners (``tls`` says with which certificates)."""
    tls: GatewayTls = GatewayTls()
    workers: int | Literal["auto"] = 1
    """Processes that serve traffic. 1: the gateway's own process; N > 1: N worker processes
    sharing ``listen`` (SO_REUSEPORT), fed by the one controller (``gateway.workers.supervisor``);
    ``auto``: one per CPU this process may run on."""

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> object:
        if value == "auto" or (type(value) is int and 1 <= value <= 64):
            return value
        raise ValueError("must be a number of processes from 1 to 64, or 'auto'")

    @property
    def worker_count(self) -> int:
        if self.workers == "auto":
            return max(1, min(64, len(os.sched_getaffinity(0))))
        return self.workers

    admin: AdminConfig = AdminConfig()
    state_dir: str = "./state"
    services: tuple[str | dict[str, Any], ...] = ()
    """Specs applied at start-up: paths of YAML/JSON files, or inline specs."""
    backends: BackendsConfig = BackendsConfig()
    proxy: ProxyOptions = ProxyOptions()
    access_log: AccessLogConfig = AccessLogConfig()
    tracing: TracingConfig = TracingConfig()
    """W3C Trace Context propagation (``traceparent``, ``tracestate``); on by default."""
    models: ModelsConfig | None = None
    """The traffic listener as an OpenAI-compatible endpoint: requests under
    ``models.path_prefix`` go to the service whose ``model`` their body names; off unless set."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    replicas_on_exit: Literal["keep", "stop"] = "keep"
    """On shutdown, leave process replicas running for the next start to adopt (``keep``),
    or stop them (``stop``)."""
    state: StateConfig = StateConfig()
    """Where the state lives: SQLite on this node (default), or etcd shared by a cluster."""
    node: NodeConfig = NodeConfig()
    """This process as a node of a cluster (with ``state.store: etcd``)."""

    @model_validator(mode="after")
    def _tls_needs_certificates(self) -> GatewayConfig:
        if self.listen_tls and not self.tls.certificates and self.tls.acme is None:
            raise ValueError(
                "listen_tls: an HTTPS listener needs tls.certificates or tls.acme to serve"
            )
        return self

    @model_validator(mode="after")
    def _cluster_admin_reachable(self) -> GatewayConfig:
        # Every admin request a follower takes is forwarded to the leader's node.address.
        if self.state.store == "etcd":
            reason = self.node.admin_unreachable(self.admin.listen)
            if reason is not None:
                raise ValueError(reason)
        return self

    def proxy_config(self) -> ProxyConfig:
        tls = TlsConfig(**{f.name: getattr(self.tls, f.name) for f in fields(TlsConfig)})
        return ProxyConfig(
            listen=self.listen,
            listen_tls=self.listen_tls,
            tls=tls,
            tracing=self.tracing,
            models=self.models,
            **dict(self.proxy),
        )

    def admin_token(self) -> str | None:
        """The admin token from the file or the environment, or None if neither is set."""
        if self.admin.token_file:
            try:
                return Path(self.admin.token_file).read_text().strip() or None
            except OSError as e:
                raise ConfigError(f"admin.token_file: cannot read: {e.strerror}") from None
        if self.admin.token_env:
            return os.environ.get(self.admin.token_env) or None
        return None


class ConfigService(Model):
    """One entry of the config's ``services``: its validated spec, and where it came from."""

    source: str
    """The spec file's path (as the config names it, joined to the config's directory), or
    ``<config> services[i]`` for an inline spec: what the start-up log names."""
    digest: str
    """``document_digest`` of the document as written, before validation."""
    spec: ServiceSpec


class LoadedConfig(Model):
    """The config with its paths resolved and its service specs validated."""

    path: str
    config: GatewayConfig
    state_dir: str
    services: tuple[ConfigService, ...]

    @property
    def specs(self) -> tuple[ServiceSpec, ...]:
        return tuple(s.spec for s in self.services)


def document_digest(data: Any) -> str:
    """sha256 of a spec document's content: its canonical JSON, so comments, layout and key
    order do not count. A relative ``working_dir`` counts as written, not as resolved."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def format_validation_error(error: ValidationError) -> list[dict[str, str]]:
    """Pydantic's errors as ``[{"field": "route.path_prefix", "reason": "..."}]``."""
    out = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "(top level)"
        reason = item["msg"].removeprefix("Value error, ")
        if item["type"] == "unexpected_keyword_argument":  # a field of a gateway.config dataclass
            reason = "Extra inputs are not permitted"
        out.append({"field": field, "reason": reason})
    return out


def _describe(source: str, error: ValidationError) -> str:
    lines = [f"{source}: invalid"]
    lines += [f"  {e['field']}: {e['reason']}" for e in format_validation_error(error)]
    return "\n".join(lines)


def read_document(path: Path) -> Any:
    """A YAML file (JSON if its name ends in ``.json``) within the limits of ``documents``;
    ConfigError names the file and the limit passed."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return documents.parse(text, "json" if path.suffix == ".json" else "yaml")
    except DocumentTooLarge as e:
        raise ConfigError(f"{path}: refused: {e.message} (limit: {e.limit})") from None
    except DocumentError as e:
        raise ConfigError(f"{path}: {e.message}") from None


def parse_spec(data: Any, source: str, base_dir: Path | None = None) -> ServiceSpec:
    """Validate one service spec; a relative ``working_dir`` is resolved against base_dir."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a service spec must be a mapping")
    try:
        spec = ServiceSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(source, e)) from None
    wd = spec.replica.working_dir
    if base_dir is not None and wd is not None and not os.path.isabs(wd):
        replica = spec.replica.model_copy(update={"working_dir": str((base_dir / wd).resolve())})
        spec = spec.model_copy(update={"replica": replica})
    return spec


def load_config(path: str | Path, *, workers: int | str | None = None) -> LoadedConfig:
    """Read, validate and resolve a gateway config file; raises ConfigError.

    ``workers`` (the command line's ``--workers``) takes the place of the file's.
    """
    file = Path(path)
    data = read_document(file)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the config must be a mapping")
    if workers is not None:
        data = {**data, "workers": workers}
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(str(file), e)) from None
    base = file.resolve().parent
    services: list[ConfigService] = []
    for i, entry in enumerate(config.services):
        if isinstance(entry, str):
            spec_path = base / entry
            document = read_document(spec_path)
            spec = parse_spec(document, str(spec_path), spec_path.parent)
            source = str(file.parent / entry)
        else:
            document = entry
            spec = parse_spec(entry, f"{file}: services[{i}]", base)
            source = f"{file} services[{i}]"
        services.append(ConfigService(source=source, digest=document_digest(document), spec=spec))
    names = [s.spec.name for s in services]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{file}: services: {name!r} is declared more than once")
    for i, applied in enumerate(services):
        clash = model_clash(applied.spec, (s.spec for s in services[:i]))
        if clash is not None:
            raise ConfigError(f"{applied.source}: {clash}")
    state_dir = Path(config.state_dir)
    if not state_dir.is_absolute():
        state_dir = base / state_dir
    token_file = config.admin.token_file
    if token_file is not None and not Path(token_file).is_absolute():
        admin = config.admin.model_copy(update={"token_file": str(base / token_file)})
        config = config.model_copy(update={"admin": admin})
    if config.tls.certificates:  # relative to the config file, as the other paths
        pairs = tuple(
            replace(pair, cert_file=str(base / pair.cert_file), key_file=str(base / pair.key_file))
            for pair in config.tls.certificates
        )
        config = config.model_copy(update={"tls": replace(config.tls, certificates=pairs)})
    return LoadedConfig(
        path=str(file), config=config, state_dir=str(state_dir), services=tuple(services)
    )
