"""Prometheus metrics of scoring jobs, shared by the REST service and the batch CLI.

The service (``pairclean_service.metrics.Metrics``) follows its jobs' folders and counts
what they commit; ``pairclean score --metrics-port PORT`` serves the same families from the
driver of a batch job, so one dashboard (``deploy/grafana``) reads both. Labels are
bounded (states and statuses, never a job id, a shard or a sample).

Why prometheus_client rather than Ray's own metrics (``ray.util.metrics``): those exist only
on Ray (``--executor local`` has none), are renamed with a ``ray_`` prefix, and reach
Prometheus through each node's metrics agent, so the service's dashboard could not read the
batch job's figures under the same names. The driver already receives every shard's
completion record (a few hundred bytes: statuses, stage timings), which is all these need;
the weight and similarity histograms read three columns of the committed table.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pairclean import schema

__all__ = ["BatchMetrics", "JobMetrics", "MetricsProgress", "STAGES", "sample_names", "serve"]

log = logging.getLogger(__name__)

_UNIT_BUCKETS = tuple(round(0.1 * i, 1) for i in range(1, 11))
_SIM_BUCKETS = tuple(round(-0.2 + 0.1 * i, 1) for i in range(0, 11))
_STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
STAGES = ("read_decode", "embed", "write")


class JobMetrics:
    """What committed and quarantined shards say: shards, pairs by status, stage seconds,
    weight and similarity histograms, failed attempts. One registry per instance (tests build
    many in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.pairs = Counter("pairclean_pairs_scored_total", "Pairs scored, by row status", ["status"], registry=r)
        self.shards = Counter("pairclean_shards_total", "Shards finished, by outcome", ["state"], registry=r)
        self.stage = Histogram("pairclean_stage_seconds", "Seconds per shard spent in each stage", ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.weights = Histogram("pairclean_pair_weight", "Cleanliness weights of scored pairs", buckets=_UNIT_BUCKETS, registry=r)
        self.similarities = Histogram("pairclean_pair_similarity", "Cosine similarities of scored pairs", buckets=_SIM_BUCKETS, registry=r)
        self.retries = Counter("pairclean_shard_attempts_failed_total", "Shard attempts that failed and were retried or quarantined", registry=r)

    def shard_committed(self, record: dict[str, Any], read_scores: Callable[[list[str]], Any]) -> None:
        """Account for one committed shard: statuses, stage times, weight/similarity histograms."""
        self.shards.labels(state=schema.SHARD_COMMITTED).inc()
        self.retries.inc(max(0, _count(record.get("attempts", 1)) - 1))  # tries that failed before this one
        statuses = record.get("statuses")
        for status, count in (statuses.items() if isinstance(statuses, dict) else ()):
            # The record lives in the tenant's own folder: its keys are bounded to the known
            # statuses here (an edited record made label values of anything, and a negative
            # count stopped the runner following the job)
            self.pairs.labels(status=status if status in schema.STATUSES else "other").inc(_count(count))
        timings = record.get("timings")
        for stage, seconds in (timings.items() if isinstance(timings, dict) else ()):
            if stage in STAGES and isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0:
                self.stage.labels(stage=stage).observe(seconds)
        self._observe_values(read_scores)

    def shard_quarantined(self, attempts: Any) -> None:
        self.shards.labels(state=schema.SHARD_QUARANTINED).inc()
        self.retries.inc(_count(attempts))

    def _observe_values(self, read_scores: Callable[[list[str]], Any]) -> None:
        try:
            table = read_scores([schema.COL_STATUS, schema.COL_SIMILARITY, schema.COL_WEIGHT])
        except Exception:  # noqa: BLE001 - metrics must never fail a job
            return
        ok = schema.ok_mask(table)
        for keep, sim, weight in zip(ok, table.column(schema.COL_SIMILARITY).to_pylist(), table.column(schema.COL_WEIGHT).to_pylist()):
            if keep and sim is not None and not math.isnan(sim):
                self.similarities.observe(sim)
                self.weights.observe(weight)


class BatchMetrics(JobMetrics):
    """A batch job's metrics (``pairclean score --metrics-port``): the job families plus its
    progress, ``pairclean_batch_shards{state}`` (total, committed, quarantined; committed
    counts the shards an earlier run of the job committed too)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.progress = Gauge("pairclean_batch_shards", "The batch job's shards: total, committed (earlier runs too), quarantined",
                              ["state"], registry=self.registry)


class MetricsProgress:
    """A ``pairclean.job.runner.Progress`` that updates ``metrics`` and passes every event on
    to ``inner`` (the progress bar). ``read_scores(record, columns)`` reads a committed
    shard's table (``OutputDir.read_scores``)."""

    def __init__(self, metrics: BatchMetrics, read_scores: Callable[[Any, list[str]], Any], inner: Any = None) -> None:
        self.metrics, self.read_scores, self.inner = metrics, read_scores, inner
        self.committed = self.quarantined = 0

    def start(self, total_shards: int, already_done: int) -> None:
        self.committed = already_done
        self.metrics.progress.labels(state="total").set(total_shards)
        self._set()
        if self.inner is not None:
            self.inner.start(total_shards, already_done)

    def shard_done(self, record: Any) -> None:
        self.committed += 1
        self.metrics.shard_committed(record.to_json(), lambda cols: self.read_scores(record, cols))
        self._set()
        if self.inner is not None:
            self.inner.shard_done(record)

    def shard_failed(self, uri: str, error: str, attempts: int = 1) -> None:
        self.quarantined += 1
        self.metrics.shard_quarantined(attempts)
        self._set()
        if self.inner is not None:
            self.inner.shard_failed(uri, error)

    def _set(self) -> None:
        self.metrics.progress.labels(state="committed").set(self.committed)
        self.metrics.progress.labels(state="quarantined").set(self.quarantined)


def serve(registry: CollectorRegistry, port: int, host: str) -> int:
    """Serve ``registry`` at ``http://HOST:PORT/metrics`` from a daemon thread for the rest of
    the process; returns the port (the one the system chose for port 0). ``OSError`` (port
    taken, address not local) is the caller's to report."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_address[1])


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` exports (what a Grafana or alert expression may use)."""
    names: set[str] = set()
    for family in registry.collect():
        if family.samples:  # what it really writes (a histogram with negative buckets has no _sum)
            names.update(sample.name for sample in family.samples)
        else:  # labelled, no child yet: the names its type writes
            names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def _count(value: Any) -> int:
    """A count read from a job's own files as a whole number >= 0 (0 for anything else)."""
    try:
        return max(0, int(value))
    except (TypeError, ValueError, OverflowError):
        return 0
