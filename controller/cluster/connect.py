"""The etcd client of this node, made from ``state.etcd`` (endpoints, TLS, credentials)."""

from __future__ import annotations

import ssl

from controller.cluster.config import EtcdConfig, EtcdTls
from controller.etcd import EtcdClient


def tls_context(tls: EtcdTls | None) -> ssl.SSLContext | None:
    """The context for ``https`` endpoints: the CA that signed etcd's certificates (the
    system's when not given) and the client pair if etcd asks for one. None: defaults."""
    if tls is None:
        return None
    context = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


def connect(config: EtcdConfig) -> EtcdClient:
    """An EtcdClient for ``config`` (nothing is sent until the first call). Reads the password
    from the environment variable the config names; the files of ``tls`` now."""
    return EtcdClient(
        config.endpoints,
        timeout=float(config.timeout),
        username=config.username,
        password=config.password(),
        ssl_context=tls_context(config.tls),
    )
