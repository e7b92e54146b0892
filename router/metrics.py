"""Prometheus metrics of one proxy instance, in a registry of its own (no global state).

The per-request series (``kvl_requests_total``, ``kvl_request_latency_seconds``,
``kvl_time_to_first_token_seconds``) are plain numbers that a request updates in place and the
scrape turns into metric families: prometheus_client's ``Counter`` and ``Histogram`` take a
lock and a few calls per update, which every request paid three times; the proxy runs on one
event loop, and the scrape runs on it too, so nothing else can see a half-made update.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from router.fleet import Fleet

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _FleetCollector(Collector):
    """Gauges read at scrape time from the fleet and the ledger, so nothing keeps them in sync."""

    def __init__(self, fleet: Fleet, ledger_stats: Callable[[], dict[str, Any]]) -> None:
        self._fleet = fleet
        self._ledger_stats = ledger_stats

    def collect(self) -> Iterator[Metric]:
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
        ticks = CounterMetricFamily("kvl_monitor_ticks", "Health checks of the whole fleet done")
        ticks.add_metric([], float(self._fleet.monitor_ticks))
        yield ticks
        lost = CounterMetricFamily(
            "kvl_ledger_epoch_lost", "Times this proxy found that Redis lost the ledger's data"
        )
        lost.add_metric([], float(stats.get("epoch_lost_total", 0)))
        yield lost


class _Histogram:
    """Counts per bucket (not cumulative; the last is above every bound) and their sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(_LATENCY_BUCKETS, value)] += 1  # le: value <= bound
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        bounds = [*map(floatToGoString, _LATENCY_BUCKETS), "+Inf"]
        running, cumulative = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            cumulative.append((bound, float(running)))
        return cumulative


class _Replica:
    """One replica's per-request series."""

    __slots__ = ("statuses", "created", "latency", "ttft")

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.created: dict[str, float] = {}
        self.latency = _Histogram()
        self.ttft = _Histogram()


class _RequestCollector(Collector):
    def __init__(self, replicas: dict[str, _Replica]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "kvl_requests", "Proxied requests", labels=["replica", "status"]
        )
        latency = HistogramMetricFamily(
            "kvl_request_latency_seconds", "End-to-end latency", labels=["replica"]
        )
        ttft = HistogramMetricFamily(
            "kvl_time_to_first_token_seconds",
            "Time to first token reported by the engine",
            labels=["replica"],
        )
        for replica_id, replica in sorted(self._replicas.items()):
            for status, count in sorted(replica.statuses.items()):
                created = replica.created[status]
                requests.add_metric([replica_id, status], count, created=created)
            latency.add_metric([replica_id], replica.latency.buckets(), replica.latency.total)
            ttft.add_metric([replica_id], replica.ttft.buckets(), replica.ttft.total)
        yield from (requests, latency, ttft)


class Metrics:
    def __init__(self, fleet: Fleet, ledger_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self._replicas: dict[str, _Replica] = {}
        self.registry.register(_RequestCollector(self._replicas))
        self.registry.register(_FleetCollector(fleet, ledger_stats))
        self._moves = _MoveCollector()
        self.registry.register(self._moves)

    def observe(self, record: dict[str, Any], latency_s: float) -> None:
        replica_id, status = str(record["replica"]), str(record["status"])
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = _Replica()
        statuses = replica.statuses
        if status in statuses:
            statuses[status] += 1
        else:
            statuses[status] = 1
            replica.created[status] = time.time()
        replica.latency.observe(latency_s)
        replica.ttft.observe(float(record["ttft_ms"]) / 1000)

    def moved(self, outcome: str, seconds: float) -> None:
        """An eval run's failover ended (``moved`` or ``broken``) after ``seconds``."""
        self._moves.counts[outcome] = self._moves.counts.get(outcome, 0) + 1
        self._moves.duration.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _MoveCollector(Collector):
    """Eval run failovers (``router.eval.failover``): how each ended, and how long it took."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.duration = _Histogram()

    def collect(self) -> Iterator[Metric]:
        moves = CounterMetricFamily(
            "kvl_run_moves", "Eval run failovers by outcome", labels=["outcome"]
        )
        for outcome, count in sorted(self.counts.items()):
            moves.add_metric([outcome], count)
        duration = HistogramMetricFamily(
            "kvl_run_move_seconds", "Eval run failover time (lease, reset, replay)"
        )
        duration.add_metric([], self.duration.buckets(), self.duration.total)
        yield from (moves, duration)
