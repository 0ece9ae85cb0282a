"""A cluster node's metrics, read at scrape time: who it is, whether it leads, what it sees.

Every series carries ``node`` (this node's name), so the nodes of one cluster scraped into one
Prometheus tell apart without relabelling:

- ``gateway_cluster_node_info{node, role}`` 1 (role: ``leader``, ``follower``, ``starting``);
- ``gateway_cluster_leader{node}`` 1 while this node leads;
- ``gateway_cluster_nodes{node}`` the live nodes this node sees (its lease view);
- ``gateway_cluster_etcd_reachable{node}`` 0 while etcd does not answer this node;
- ``gateway_cluster_terms_total{node}`` the terms this node began as leader;
- ``gateway_cluster_etcd_requests_total{node, part}`` requests this node's parts made
  (``state``: the store's; ``pools``: publishing and following pools).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .node import ClusterNode


class NodeMetrics(Collector):
    def __init__(self, node: ClusterNode) -> None:
        self._node = node

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        node = self._node
        name = node.name
        info = GaugeMetricFamily(
            "gateway_cluster_node_info", "This gateway as a cluster node", labels=["node", "role"]
        )
        info.add_metric([name, node.role], 1)
        yield info
        leader = GaugeMetricFamily(
            "gateway_cluster_leader", "1 while this node leads the cluster", labels=["node"]
        )
        leader.add_metric([name], 1 if node.leading() else 0)
        yield leader
        nodes = GaugeMetricFamily(
            "gateway_cluster_nodes", "Live nodes of the cluster, as this node sees them",
            labels=["node"],
        )  # fmt: skip
        nodes.add_metric([name], len(node.nodes()))
        yield nodes
        reachable = GaugeMetricFamily(
            "gateway_cluster_etcd_reachable", "0 while etcd does not answer this node",
            labels=["node"],
        )  # fmt: skip
        reachable.add_metric([name], 1 if node.store_reachable() else 0)
        yield reachable
        terms = CounterMetricFamily(
            "gateway_cluster_terms", "Terms this node began as the leader", labels=["node"]
        )
        terms.add_metric([name], node.terms)
        yield terms
        requests = CounterMetricFamily(
            "gateway_cluster_etcd_requests", "etcd requests made by this node's parts",
            labels=["node", "part"],
        )  # fmt: skip
        requests.add_metric([name, "state"], node.store.requests)
        requests.add_metric([name, "pools"], node.pool_requests())
        yield requests


def register_node(registry: CollectorRegistry, node: ClusterNode) -> NodeMetrics:
    metrics = NodeMetrics(node)
    registry.register(metrics)
    return metrics
