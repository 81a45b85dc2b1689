"""The PS shard's Prometheus metrics: lookup and update latency, ids looked up, RPC errors; the
store's gauges and counters are read from ``store.stats()`` at scrape time."""

from __future__ import annotations


class PSMetrics:
    """Lookup latency histogram and id counter; store gauges are read at scrape time."""

    def __init__(self, store):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from serving.rpc.metrics import LATENCY_BUCKETS, rpc_errors

        self.registry = CollectorRegistry()
        self.lookup_seconds = Histogram(
            "recserve_ps_lookup_seconds",
            "PS Lookup time in the server",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.lookup_ids = Counter("recserve_ps_lookup_ids", "Signs looked up", registry=self.registry)
        self.errors = rpc_errors("recserve_ps_errors", self.registry)
        self.update_seconds = Histogram(
            "recserve_ps_update_seconds",
            "PS Update time in the server",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        class StoreCollector:
            def collect(self):
                st = store.stats()
                for name, help_text in (
                    ("rows", "rows held"),
                    ("capacity", "row capacity"),
                    ("memory_bytes", "bytes of all store arrays"),
                    ("delta_seq", "last delta applied or cut"),
                ):
                    yield GaugeMetricFamily(f"recserve_ps_{name}", help_text, value=st[name])
                if st.get("version"):  # a serving shard: the version it answers from
                    served = GaugeMetricFamily(
                        "recserve_ps_version", "1 for the version served", labels=["version"]
                    )
                    served.add_metric([str(st["version"])], 1)
                    yield served
                for name, help_text in (
                    ("hits", "signs found"),
                    ("misses", "signs answered with the default row"),
                    ("inserts", "rows inserted"),
                    ("evictions", "rows evicted by the eviction policy (lru/lfu)"),
                    ("expired", "rows removed by the TTL"),
                    ("grows", "times the store grew (eviction none)"),
                ):
                    yield CounterMetricFamily(f"recserve_ps_{name}", help_text, value=st[name])

        self.registry.register(StoreCollector())
