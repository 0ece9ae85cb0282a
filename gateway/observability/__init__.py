"""What the data plane tells of itself: plain counts on the request path, read at scrape time.

    tally         latency buckets, and a worker's tally of its requests, as plain data
    status_codes  the answers counted by their code
    metrics       GatewayMetrics: requests, probes, upstream health and ejections, as plain
                  counts
    accesslog     AccessLog: one line per request, written off the event loop
    tracing       W3C Trace Context: each request's traceparent read, and sent upstream
    spans         a sampled request's server span and client spans, as plain tuples
    span_buffer   SpanBuffer: finished spans waiting to leave, bounded, in batches
    otlp          spans as OTLP protobuf (opentelemetry-proto; the main process's only)
    exporter      SpanExporter: the main process's task that POSTs the batches to a
                  collector, off the request path
    scrape        the Prometheus collectors and the ``/metrics`` exposition (the main
                  process's only: a worker imports no prometheus_client)

The HTTPS listeners' and the worker processes' collectors are theirs (``tls.metrics``,
``workers.metrics``).
"""

from .. import native

native.use_in(__path__, __name__)  # first: the compiled modules, if built (native.py)
