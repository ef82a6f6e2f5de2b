"""A Python client for the pairclean REST API.

Its method names follow Ray's ``JobSubmissionClient`` where the concepts match:

=====================  ==========================================  =========================
Ray                    here                                        returns
=====================  ==========================================  =========================
``submit_job``         ``submit_job(shards, output, ...)``         the job id
``get_job_status``     ``get_job_status(job_id)``                  the state (``QUEUED`` ...)
``get_job_info``       ``get_job_info(job_id)``                    the job as a dict
``list_jobs``          ``list_jobs(state=None)``                   every visible job (dicts)
``stop_job``           ``stop_job(job_id)``                        False if it had ended
``get_job_logs``       ``get_job_logs(job_id)``                    the job's log text
``tail_job_logs``      ``tail_job_logs(job_id)``                   an iterator of log chunks
=====================  ==========================================  =========================

Differences: a job is a scoring request (shards, output, estimator), not an entrypoint
command; ``tail_job_logs`` is a plain (synchronous) iterator that polls, where Ray's is
async. pairclean's own verbs stay: ``submit``, ``status``, ``list`` (one page), ``cancel``,
``retry``, ``validate`` and ``wait``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx

from pairclean.errors import PaircleanError
from pairclean.job.lifecycle import SUCCEEDED, TERMINAL

__all__ = ["PaircleanClient", "JobFailed", "ServiceError", "TERMINAL"]


class JobFailed(RuntimeError):
    """``wait`` ended on a job that did not succeed."""


class ServiceError(PaircleanError, RuntimeError):
    """The service refused a call (``status_code`` is its HTTP status; 0: not reachable).

    A ``PaircleanError``, so the ``pairclean`` command prints it as one line.
    """

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class PaircleanClient:
    """One service at ``address``, authenticated with ``api_key`` (``Authorization: Bearer``)."""

    def __init__(self, address: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.address = address.rstrip("/")
        self._http = httpx.Client(base_url=self.address, headers=headers, timeout=timeout)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServiceError(f"cannot reach the pairclean service at {self.address}: {exc}", 0) from exc
        if response.status_code >= 400:
            detail = response.json().get("detail") if response.headers.get("content-type", "").startswith("application/json") else response.text
            raise ServiceError(f"{method} {path}: {response.status_code} {detail}", response.status_code)
        return response.json()

    # -- Ray JobSubmissionClient names -----------------------------------------------------
    def submit_job(self, shards: list[str], output: str, *, idempotency_key: str | None = None, **fields: Any) -> str:
        """Submit a job; returns its id (the same id again for a repeated idempotency key).

        ``fields``: ``estimator``, ``beta_recipe``, ``weighting``, ``options`` (the request's fields).
        """
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return str(self._call("POST", "/v1/jobs", json={"shards": shards, "output": output, **fields}, headers=headers)["id"])

    def get_job_info(self, job_id: str) -> dict[str, Any]:
        """The job: state, request, progress, error, timestamps."""
        return dict(self._call("GET", f"/v1/jobs/{job_id}"))

    def get_job_status(self, job_id: str) -> str:
        """The job's state, one of ``pairclean.job.lifecycle.STATES``."""
        return str(self.get_job_info(job_id)["state"])

    def list_jobs(self, state: str | None = None, page_size: int = 500) -> list[dict[str, Any]]:
        """Every job the key may see (its owner's; all for an admin key), newest first, page by page."""
        jobs: list[dict[str, Any]] = []
        while True:
            page = self.list(limit=page_size, offset=len(jobs), state=state)
            jobs += page["items"]
            if not page["items"] or len(jobs) >= page["total"]:
                return jobs

    def stop_job(self, job_id: str) -> bool:
        """Ask the job to stop; False if it had already ended (it is left as it was)."""
        try:
            self.cancel(job_id)
        except ServiceError as exc:
            if exc.status_code == 409:
                return False
            raise
        return True

    def get_job_logs(self, job_id: str) -> str:
        """Everything the job's process has written so far."""
        chunks, offset = [], 0
        while True:
            page = self._logs(job_id, offset)
            chunks.append(page["text"])
            if page["next_offset"] >= page["size"] or page["next_offset"] == offset:
                return "".join(chunks)
            offset = page["next_offset"]

    def tail_job_logs(self, job_id: str, poll: float = 1.0) -> Iterator[str]:
        """The job's log as it grows, chunk by chunk, until the job has ended and all is read."""
        offset = 0
        while True:
            ended = self.get_job_status(job_id) in TERMINAL  # asked before reading: nothing is missed
            page = self._logs(job_id, offset)
            if page["text"]:
                yield page["text"]
            moved = page["next_offset"] != offset
            offset = page["next_offset"]
            if ended and (offset >= page["size"] or not moved):
                return
            if not moved or offset >= page["size"]:
                time.sleep(poll)

    def _logs(self, job_id: str, offset: int) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{job_id}/logs", params={"offset": offset}))

    # -- pairclean's own verbs -----------------------------------------------------------
    def submit(self, shards: list[str], output: str, *, idempotency_key: str | None = None, **fields: Any) -> str:
        """``submit_job``."""
        return self.submit_job(shards, output, idempotency_key=idempotency_key, **fields)

    def validate(self, shards: list[str], output: str, **fields: Any) -> dict[str, Any]:
        """Check a request without submitting it: shard count, and a bounded read of the first shard."""
        return dict(self._call("POST", "/v1/jobs:validate", json={"shards": shards, "output": output, **fields}))

    def status(self, job_id: str) -> dict[str, Any]:
        """``get_job_info``."""
        return self.get_job_info(job_id)

    def list(self, limit: int = 50, offset: int = 0, state: str | None = None) -> dict[str, Any]:
        """One page of jobs: ``{"items", "total", "limit", "offset"}``."""
        params: dict[str, Any] = {"limit": limit, "offset": offset} | ({"state": state} if state else {})
        return dict(self._call("GET", "/v1/jobs", params=params))

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job (queued: at once; running: its process is ended); 409 if it has ended."""
        return dict(self._call("POST", f"/v1/jobs/{job_id}:cancel"))

    def retry(self, job_id: str) -> dict[str, Any]:
        """Requeue a PARTIAL or FAILED job: only its uncommitted shards are redone."""
        return dict(self._call("POST", f"/v1/jobs/{job_id}:retry"))

    def wait(self, job_id: str, timeout: float = 3600.0, poll: float = 1.0) -> dict[str, Any]:
        """Poll until the job ends; raises ``JobFailed`` unless it SUCCEEDED, TimeoutError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.status(job_id)
            if job["state"] in TERMINAL:
                if job["state"] != SUCCEEDED:
                    raise JobFailed(f"job {job_id} ended {job['state']}: {job.get('error')}")
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(poll)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PaircleanClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
