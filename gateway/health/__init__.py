"""Active health checking: the probes of every upstream, and what their results make of its
health.

    state         HealthState: the rise/fall counters of one upstream's probes (PURE)
    probe_client  the HTTP probe's client: one HTTP/1.1 request on a new connection
    prober        Prober: one task per upstream, jittered; sets the health in the pool
    load_report   a replica's own figures of its load, read from its metrics (PURE)
    load_scraper  LoadScraper: scrapes them per service (``load_metrics``) into the pool

Passive detection (failures on real traffic) is the pool's: ``pool.outlier``.
"""
