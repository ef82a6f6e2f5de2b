"""Prometheus metrics of the service: names start with ``pairclean_``, labels are bounded
(states and statuses, never a job id, a shard or a sample)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pairclean import schema

__all__ = ["Metrics", "REFUSED_BODY_ROUTE", "exported_names", "STAGES"]

_UNIT_BUCKETS = tuple(round(0.1 * i, 1) for i in range(1, 11))
_SIM_BUCKETS = tuple(round(-0.2 + 0.1 * i, 1) for i in range(0, 11))
_STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
STAGES = ("read_decode", "embed", "write")


#: The ``route`` of requests the body limit refused (413, 408) before any route matched.
REFUSED_BODY_ROUTE = "refused_body"


class Metrics:
    """One registry per app (tests build many apps in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Gauge("pairclean_jobs", "Jobs by state", ["state"], registry=r)
        self.pairs = Counter("pairclean_pairs_scored_total", "Pairs scored, by row status", ["status"], registry=r)
        self.shards = Counter("pairclean_shards_total", "Shards finished, by outcome", ["state"], registry=r)
        self.stage = Histogram("pairclean_stage_seconds", "Seconds per shard spent in each stage", ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.weights = Histogram("pairclean_pair_weight", "Cleanliness weights of scored pairs", buckets=_UNIT_BUCKETS, registry=r)
        self.similarities = Histogram("pairclean_pair_similarity", "Cosine similarities of scored pairs", buckets=_SIM_BUCKETS, registry=r)
        self.retries = Counter("pairclean_shard_attempts_failed_total", "Shard attempts that failed and were retried or quarantined", registry=r)
        self.requeued = Counter("pairclean_jobs_requeued_total", "RUNNING jobs of a lost replica taken over: queued again to resume, or cancelled as asked", registry=r)
        self.requests = Counter("pairclean_http_requests_total", "HTTP requests, by route group and status class", ["route", "code"], registry=r)
        self.latency = Histogram("pairclean_http_request_seconds", "HTTP request latency", ["route"], registry=r)
        # The audit loop (issue 22): labels stored and reports computed, never a figure of one
        # job: /metrics answers without a key, and the latest estimate (with its interval and
        # label counts) was one tenant's result shown to anyone.
        self.audit_labels = Counter("pairclean_audit_labels_total", "Human audit labels stored, by label", ["label"], registry=r)
        self.audit_reports = Counter("pairclean_audit_reports_total", "Audit reports computed, by outcome (ok, needs_labels)",
                                     ["status"], registry=r)

    def jobs_by_state(self, counts: dict[str, int]) -> None:
        for state, count in counts.items():
            self.jobs.labels(state=state).set(count)

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
        for stage, seconds in record.get("timings", {}).items():
            if stage in STAGES:
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

    def render(self) -> bytes:
        return generate_latest(self.registry)


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Every sample name the service exports (what a Grafana expression may use)."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
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
