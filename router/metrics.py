"""Prometheus metrics of one proxy instance, in a registry of its own (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.fleet import Fleet

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _FleetCollector(Collector):
    """Gauges read at scrape time from the fleet and the ledger, so nothing keeps them in sync."""

    def __init__(self, fleet: Fleet, ledger_stats: Callable[[], dict[str, Any]]) -> None:
        self._fleet = fleet
        self._ledger_stats = ledger_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gen = GaugeMetricFamily("kvl_replica_generation", "Cache generation", labels=["replica"])
        ready = GaugeMetricFamily("kvl_replica_ready", "1 if ready", labels=["replica"])
        flight = GaugeMetricFamily(
            "kvl_replica_in_flight", "Requests in flight", labels=["replica"]
        )
        ratio = GaugeMetricFamily(
            "kvl_replica_reused_block_ratio", "Reused / total KV blocks", labels=["replica"]
        )
        for r in self._fleet:
            gen.add_metric([r.id], r.generation)
            ready.add_metric([r.id], 1 if r.healthy else 0)
            flight.add_metric([r.id], r.in_flight)
            ratio.add_metric([r.id], r.reused_blocks / r.total_blocks if r.total_blocks else 0.0)
        yield from (gen, ready, flight, ratio)
        stats = self._ledger_stats()
        for name, help_text in (
            ("buffer_depth", "Lineage records waiting in memory"),
            ("spooled", "Lineage records waiting in the spool file"),
            ("spooled_total", "Lineage records ever spooled"),
            ("dropped_total", "Lineage records dropped (spool disk full)"),
            ("written_total", "Lineage records written to Redis"),
        ):
            family = GaugeMetricFamily(f"kvl_ledger_{name}", help_text)
            family.add_metric([], float(stats.get(name, 0)))
            yield family
        up = GaugeMetricFamily("kvl_ledger_redis_up", "1 while Redis answers")
        up.add_metric([], 1.0 if stats.get("redis_up") else 0.0)
        yield up


class Metrics:
    def __init__(self, fleet: Fleet, ledger_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvl_requests", "Proxied requests", ["replica", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "kvl_request_latency_seconds",
            "End-to-end latency",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvl_time_to_first_token_seconds",
            "Time to first token reported by the engine",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_FleetCollector(fleet, ledger_stats))
        # Each (replica, status)'s children, looked up once: labels() costs more than the update.
        self._children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def observe(self, record: dict[str, Any], latency_s: float) -> None:
        key = (str(record["replica"]), str(record["status"]))
        children = self._children.get(key)
        if children is None:
            replica, status = key
            children = (
                self.requests.labels(replica, status),
                self.latency.labels(replica),
                self.ttft.labels(replica),
            )
            self._children[key] = children
        requests, latency, ttft = children
        requests.inc()
        latency.observe(latency_s)
        ttft.observe(float(record["ttft_ms"]) / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
