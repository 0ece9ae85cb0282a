"""A cluster of gateway nodes sharing one state in etcd (docs/cluster.md)."""
