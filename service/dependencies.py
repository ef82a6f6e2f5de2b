"""What the routes take from the request: the caller (API key), the app's store, runner,
metrics and settings (built once per app by ``create_app``), and a job the caller may see."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Header, HTTPException, Request
from fastapi import Path as PathParam

from .metrics import Metrics
from .runner import JobRunner
from .security import hash_key, output_key
from .settings import ServiceSettings
from .store import JobRow, JobStore, Principal

__all__ = ["Caller", "JobId", "Store", "Runner", "Settings", "AppMetrics", "Validations", "ValidationPool", "Expansions", "caller",
           "job_or_404", "output_key"]

T = TypeVar("T")


@dataclass(frozen=True)
class ValidationPool:
    """Validations read shards: their own small pool (and as many slots), so slow or many
    of them never take the threads that serve ``/healthz``, ``/metrics`` and the job routes."""

    pool: ThreadPoolExecutor
    slots: threading.BoundedSemaphore

    @classmethod
    def of(cls, concurrency: int, name: str = "pairclean-validate") -> ValidationPool:
        return cls(ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=name),
                   threading.BoundedSemaphore(concurrency))

    async def run(self, wait_s: float, busy: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a thread of this pool, waiting at most ``wait_s`` for a free one
        (429 with ``busy`` then). The slot is freed when ``fn`` really ends, not when the
        request gives up on it. (A threading semaphore polled, not an asyncio one: it is
        released from the pool's done callback and shared by every event loop of the app.)"""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        while not self.slots.acquire(blocking=False):
            if loop.time() >= give_up:
                raise HTTPException(429, busy, headers={"Retry-After": "5"})
            await asyncio.sleep(0.05)
        future = loop.run_in_executor(self.pool, fn, *args)
        future.add_done_callback(lambda _: self.slots.release())
        return await asyncio.shield(future)


def get_store(request: Request) -> JobStore:
    return request.app.state.store  # type: ignore[no-any-return]


def get_runner(request: Request) -> JobRunner:
    return request.app.state.runner  # type: ignore[no-any-return]


def get_settings(request: Request) -> ServiceSettings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


def get_validations(request: Request) -> ValidationPool:
    return request.app.state.validations  # type: ignore[no-any-return]


def get_expansions(request: Request) -> ValidationPool:
    return request.app.state.expansions  # type: ignore[no-any-return]


Store = Annotated[JobStore, Depends(get_store)]
Runner = Annotated[JobRunner, Depends(get_runner)]
Settings = Annotated[ServiceSettings, Depends(get_settings)]
AppMetrics = Annotated[Metrics, Depends(get_metrics)]
Validations = Annotated[ValidationPool, Depends(get_validations)]
#: Submissions' shard expansion: its own pool (``submit_concurrency``), like validations'.
Expansions = Annotated[ValidationPool, Depends(get_expansions)]


def caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Principal:
    """The owner of the API key presented as ``Authorization: Bearer <key>``; 401 otherwise."""
    settings: ServiceSettings = request.app.state.settings
    if not settings.require_auth:
        return Principal("anonymous")
    scheme, _, key = (authorization or "").partition(" ")
    principal = request.app.state.store.principal(hash_key(key)) if scheme.lower() == "bearer" and key else None
    if principal is None:
        raise HTTPException(401, "missing or invalid API key", headers={"WWW-Authenticate": "Bearer"})
    return principal  # type: ignore[no-any-return]


Caller = Annotated[Principal, Depends(caller)]
JobId = Annotated[str, PathParam(max_length=64)]


def job_or_404(store: JobStore, job_id: str, who: Principal) -> JobRow:
    """The job, if ``who`` may see it (its owner, or an admin); 404 otherwise."""
    job = store.get(job_id)
    if job is None or not (who.admin or job.owner == who.name):
        # Another owner's job is answered exactly like a missing one.
        raise HTTPException(404, f"no job {job_id!r}")
    return job


