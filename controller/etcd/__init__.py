"""etcd v3 for the cluster: an asyncio client over etcd's JSON gateway (``client``)."""

from controller.etcd.client import EtcdClient
from controller.etcd.errors import Compacted, EtcdError, EtcdUnavailable, LeaseNotFound
from controller.etcd.wire import (
    Compare,
    Delete,
    Get,
    KeyValue,
    Op,
    Put,
    TxnResult,
    WatchEvent,
)

__all__ = [
    "Compacted",
    "Compare",
    "Delete",
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailable",
    "Get",
    "KeyValue",
    "LeaseNotFound",
    "Op",
    "Put",
    "TxnResult",
    "WatchEvent",
]
