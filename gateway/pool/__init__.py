"""The pools and the balancing: which service a request is for, and which of its upstreams
takes it.

    upstream      Upstream: the data plane's view of one replica (PURE)
    router        the route table: which service a request belongs to (PURE)
    snapshot      PoolSnapshot: a service's upstreams, published whole, immutable
    service_pool  ServicePool: one service's pool: picks, in-flight leases, slots, queues
    balancer      the load-balancing policies over the routable upstreams (PURE)
    hashring      consistent hashing of a request's key (PURE)
    outlier       passive outlier detection and ejection (PURE)
    ratelimit     a service's rate limits: token buckets per key (PURE)
    pool          Pool: the pools of all services, their changes, drains and peers
    events        what the data plane publishes (pool changes, probes, requests), and the
                  protocols of those who listen
"""

from .. import native

native.use_in(__path__, __name__)  # first: the compiled modules, if built (native.py)
