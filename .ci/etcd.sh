# Sourced by .ci/run: etcd (Debian packages "etcd-server" and "etcd-client", etcd 3.4) for the
# etcd store and cluster tests, which start and stop their own members on loopback
# (tests/support/etcd_cluster.py) and run etcdctl against them (authentication, compaction): nothing
# to clean.
if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends etcd-server etcd-client >/dev/null
fi
