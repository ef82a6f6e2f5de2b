"""Prometheus metrics of the service: names start with ``pairclean_``, labels are bounded
(states and statuses, never a job id, a shard or a sample)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pairclean_workers.metrics import STAGES, JobMetrics, sample_names

__all__ = ["Metrics", "REFUSED_BODY_ROUTE", "exported_names", "STAGES"]

#: The ``route`` of requests the body limit refused (413, 408) before any route matched.
REFUSED_BODY_ROUTE = "refused_body"


class Metrics(JobMetrics):
    """The job families (``pairclean_workers.metrics.JobMetrics``: what the runner counts of
    the shards its jobs commit) plus the service's own. One registry per app (tests build
    many apps in one process)."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        r = self.registry
        self.jobs = Gauge("pairclean_jobs", "Jobs by state", ["state"], registry=r)
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

    def render(self) -> bytes:
        return generate_latest(self.registry)


def exported_names() -> set[str]:
    """Every sample name the service exports (what a Grafana expression may use)."""
    return sample_names(Metrics().registry)
