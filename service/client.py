"""A Python client for the pairclean REST API, shaped like Ray's ``JobSubmissionClient``."""

from __future__ import annotations

import time
from typing import Any

import httpx

__all__ = ["PaircleanClient", "JobFailed"]

TERMINAL = frozenset({"SUCCEEDED", "PARTIAL", "FAILED", "CANCELLED"})  # = pairclean.lifecycle.TERMINAL (tested)


class JobFailed(RuntimeError):
    """``wait`` ended on a job that did not succeed."""


class PaircleanClient:
    """``submit``, ``status``, ``wait``, ``list``, ``cancel``, ``retry`` against one service."""

    def __init__(self, address: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=address.rstrip("/"), headers=headers, timeout=timeout)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            detail = response.json().get("detail") if response.headers.get("content-type", "").startswith("application/json") else response.text
            raise RuntimeError(f"{method} {path}: {response.status_code} {detail}")
        return response.json()

    def submit(self, shards: list[str], output: str, *, idempotency_key: str | None = None, **fields: Any) -> str:
        """Submit a job; returns its id (the same id again for a repeated idempotency key)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return str(self._call("POST", "/v1/jobs", json={"shards": shards, "output": output, **fields}, headers=headers)["id"])

    def validate(self, shards: list[str], output: str, **fields: Any) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/jobs:validate", json={"shards": shards, "output": output, **fields}))

    def status(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{job_id}"))

    def list(self, limit: int = 50, offset: int = 0, state: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit, "offset": offset} | ({"state": state} if state else {})
        return dict(self._call("GET", "/v1/jobs", params=params))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/jobs/{job_id}:cancel"))

    def retry(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/jobs/{job_id}:retry"))

    def wait(self, job_id: str, timeout: float = 3600.0, poll: float = 1.0) -> dict[str, Any]:
        """Poll until the job ends; raises ``JobFailed`` unless it SUCCEEDED, TimeoutError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.status(job_id)
            if job["state"] in TERMINAL:
                if job["state"] != "SUCCEEDED":
                    raise JobFailed(f"job {job_id} ended {job['state']}: {job.get('error')}")
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(poll)

    def close(self) -> None:
        self._http.close()
