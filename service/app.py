"""The REST front end: ``create_app(settings)`` builds a FastAPI app with its own store,
runner and metrics (nothing is built at import time).

Routes: ``POST /v1/jobs``, ``POST /v1/jobs:validate``, ``GET /v1/jobs``,
``GET /v1/jobs/{id}``, ``GET /v1/jobs/{id}/shards``, ``POST /v1/jobs/{id}:cancel``,
``POST /v1/jobs/{id}:retry`` (all with ``Authorization: Bearer <key>``), and the
unauthenticated ``/healthz``, ``/readyz``, ``/metrics``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from .metrics import Metrics
from .runner import JobRunner
from .security import UriRefused, check_uri, hash_key
from .settings import ServiceSettings
from .store import TERMINAL, JobRow, JobStore

__all__ = ["create_app", "JobRequest", "JobPublic"]

log = logging.getLogger(__name__)

_NAME = r"^[A-Za-z0-9._-]{1,100}$"


class JobOptions(BaseModel):
    """Optional scoring options (the `pairclean score` flags of the same names)."""

    model_config = {"extra": "forbid"}

    batch_size: int | None = Field(None, ge=1, le=4096)
    max_failed_fraction: float | None = Field(None, ge=0, le=1)
    max_retries: int | None = Field(None, ge=0, le=20)
    shard_timeout: float | None = Field(None, gt=0, le=86_400)
    beta_k: int | None = Field(None, ge=2, le=4096)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)


class JobRequest(BaseModel):
    """A scoring job: shard URIs (braces, globs allowed), an output folder and the method."""

    model_config = {"extra": "forbid"}

    shards: list[Annotated[str, Field(min_length=1, max_length=2048)]] = Field(min_length=1, max_length=10_000)
    output: str = Field(min_length=1, max_length=2048)
    estimator: str = Field("pairclean-lite", pattern=_NAME)
    beta_recipe: Literal["auto", "random-inputs", "shuffled", "gmm"] = "auto"
    weighting: Literal["paper", "reference", "reference-batch"] = "paper"
    options: JobOptions = Field(default_factory=JobOptions)


class Progress(BaseModel):
    shards_total: int
    shards_done: int
    shards_failed: int
    pairs: int
    pairs_per_s: float | None
    eta_s: float | None


class JobPublic(BaseModel):
    id: str
    state: Literal["QUEUED", "RUNNING", "SUCCEEDED", "PARTIAL", "FAILED", "CANCELLED"]
    request: JobRequest
    progress: Progress
    noise_rate_estimate: float | None
    output: str
    error: str | None
    created_at: str
    started_at: str | None
    finished_at: str | None


class JobPage(BaseModel):
    items: list[JobPublic]
    total: int
    limit: int
    offset: int


class ShardPublic(BaseModel):
    shard: str
    state: Literal["committed", "quarantined", "pending"]
    rows: int | None = None
    error: str | None = None


class ShardPage(BaseModel):
    items: list[ShardPublic]
    total: int
    limit: int
    offset: int


class Validation(BaseModel):
    shards: int
    first_shard: str
    samples: int
    statuses: dict[str, int]
    problems: list[str]


class Problem(BaseModel):
    detail: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "missing or invalid API key"},
    404: {"model": Problem, "description": "no such job"},
    409: {"model": Problem, "description": "the job is not in a state that allows this"},
    413: {"model": Problem, "description": "request too large"},
    422: {"model": Problem, "description": "invalid request (bad URI, refused location, bad field)"},
}


def _seconds_since(iso: str | None) -> float | None:
    if not iso:
        return None
    return max(0.0, (datetime.now(timezone.utc) - datetime.fromisoformat(iso)).total_seconds())


def _public(job: JobRow) -> JobPublic:
    elapsed = _seconds_since(job.started_at) if job.state == "RUNNING" else None
    rate = job.pairs / elapsed if elapsed and job.pairs else None
    finished = job.shards_done + job.shards_failed
    eta = elapsed / finished * (job.shards_total - finished) if elapsed and finished else None
    return JobPublic(
        id=job.id, state=job.state, request=JobRequest.model_validate(job.request),  # type: ignore[arg-type]
        progress=Progress(shards_total=job.shards_total, shards_done=job.shards_done, shards_failed=job.shards_failed,
                          pairs=job.pairs, pairs_per_s=rate, eta_s=eta),
        noise_rate_estimate=job.noise_rate, output=job.request["output"], error=job.error,
        created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
    )


def caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The name of the API key presented as ``Authorization: Bearer <key>``; 401 otherwise."""
    settings: ServiceSettings = request.app.state.settings
    if not settings.require_auth:
        return "anonymous"
    scheme, _, key = (authorization or "").partition(" ")
    owner = request.app.state.store.key_owner(hash_key(key)) if scheme.lower() == "bearer" and key else None
    if owner is None:
        raise HTTPException(401, "missing or invalid API key", headers={"WWW-Authenticate": "Bearer"})
    return str(owner)


Caller = Annotated[str, Depends(caller)]


def create_app(settings: ServiceSettings | None = None, state_dir: str | Path = "pairclean-service") -> FastAPI:
    """Build the app; the runner starts with the app's lifespan and stops with it."""
    settings = settings or ServiceSettings()
    store = JobStore(settings.database_url)
    metrics = Metrics()
    runner = JobRunner(store, settings, metrics, Path(state_dir))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="pairclean", version="0.1.0", lifespan=lifespan, responses=_ERRORS)
    app.state.store, app.state.runner, app.state.metrics, app.state.settings = store, runner, metrics, settings

    @app.middleware("http")
    async def limits_and_metrics(request: Request, call_next: Any) -> Response:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > settings.max_body_bytes:
            return JSONResponse({"detail": f"request body over {settings.max_body_bytes} bytes"}, status_code=413)
        started = time.perf_counter()
        response: Response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")  # bounded: route templates, not raw paths
        metrics.requests.labels(route=name, code=f"{response.status_code // 100}xx").inc()
        metrics.latency.labels(route=name).observe(time.perf_counter() - started)
        return response

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse({"detail": "internal error"}, status_code=500)  # never a stack trace

    def job_or_404(job_id: str) -> JobRow:
        job = store.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job

    def checked(request: JobRequest) -> int:
        """Allow-list every URI and count the shards; 422 with the reason otherwise."""
        try:
            for uri in request.shards:
                check_uri(uri, settings.allowed_inputs, settings.allow_pipe)
            check_uri(request.output, settings.allowed_outputs)
        except UriRefused as exc:
            raise HTTPException(422, str(exc)) from exc
        from pairclean.errors import PaircleanError
        from pairclean.uris import expand_shards

        try:
            shards = expand_shards(request.shards)
        except PaircleanError as exc:
            raise HTTPException(422, str(exc)) from exc
        for uri in shards:  # a glob or list file may expand outside the allowed prefixes
            try:
                check_uri(uri, settings.allowed_inputs, settings.allow_pipe)
            except UriRefused as exc:
                raise HTTPException(422, str(exc)) from exc
        return len(shards)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"model": Problem}})
    def readyz() -> JSONResponse:
        ok = store.ping() and runner._thread.is_alive()
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response)
    def prometheus() -> Response:
        metrics.jobs_by_state(store.counts_by_state())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/jobs", status_code=201, response_model=JobPublic)
    def submit(request: JobRequest, who: Caller, response: Response,
               idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> JobPublic:
        total = checked(request)
        job, created = store.create(request.model_dump(), who, idempotency_key, total)
        if not created:
            response.status_code = 200
        return _public(job)

    @app.post("/v1/jobs:validate", response_model=Validation)
    def validate(request: JobRequest, who: Caller) -> Validation:
        from pairclean.errors import PaircleanError
        from pairclean.shards import iter_pairs
        from pairclean.uris import expand_shards

        total = checked(request)
        first = expand_shards(request.shards)[0]
        statuses: dict[str, int] = {}
        problems: list[str] = []
        samples = 0
        try:
            for pair in iter_pairs(first):
                samples += 1
                statuses[pair.status] = statuses.get(pair.status, 0) + 1
                if pair.status != "ok" and len(problems) < 20:
                    problems.append(f"{pair.key}: {pair.status} ({pair.error})")
        except PaircleanError as exc:
            problems.append(str(exc))
        return Validation(shards=total, first_shard=first, samples=samples, statuses=statuses, problems=problems)

    @app.get("/v1/jobs", response_model=JobPage)
    def list_jobs(who: Caller, limit: Annotated[int, Query(ge=1, le=500)] = 50, offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
                  state: Literal["QUEUED", "RUNNING", "SUCCEEDED", "PARTIAL", "FAILED", "CANCELLED"] | None = None) -> JobPage:
        rows, total = store.list(limit, offset, state)
        return JobPage(items=[_public(r) for r in rows], total=total, limit=limit, offset=offset)

    @app.get("/v1/jobs/{job_id}", response_model=JobPublic)
    def get_job(job_id: str, who: Caller) -> JobPublic:
        return _public(job_or_404(job_id))

    @app.get("/v1/jobs/{job_id}/shards", response_model=ShardPage)
    def job_shards(job_id: str, who: Caller, state: Literal["committed", "quarantined", "pending"] | None = None,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 100, offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> ShardPage:
        job = job_or_404(job_id)
        items = [s for s in _shard_states(job) if state is None or s.state == state]
        return ShardPage(items=items[offset : offset + limit], total=len(items), limit=limit, offset=offset)

    @app.post("/v1/jobs/{job_id}:cancel", response_model=JobPublic)
    def cancel(job_id: str, who: Caller) -> JobPublic:
        job = job_or_404(job_id)
        if job.state in TERMINAL:
            raise HTTPException(409, f"job is {job.state}")
        runner.cancel(job)
        return _public(job_or_404(job_id))

    @app.post("/v1/jobs/{job_id}:retry", response_model=JobPublic)
    def retry(job_id: str, who: Caller) -> JobPublic:
        job = job_or_404(job_id)
        # Rerunning the same command resumes: only the failed (uncommitted) shards are redone.
        if not store.transition(job_id, ["PARTIAL", "FAILED"], state="QUEUED", error=None, finished_at=None, cancel_requested=0):
            raise HTTPException(409, f"only PARTIAL or FAILED jobs can be retried; this one is {job.state}")
        return _public(job_or_404(job_id))

    return app


def _shard_states(job: JobRow) -> list[ShardPublic]:
    """Every shard of a job with its state, from the job's own output folder."""
    from pairclean.job import OutputDir
    from pairclean.uris import shard_stem

    out = OutputDir(job.request["output"])
    spec = out.read_spec()
    if spec is None:
        return []  # the job has not started writing yet
    committed, failed = out.committed(), out.quarantined()
    items = []
    for uri in spec.shards:
        stem = shard_stem(uri)
        if stem in committed:
            items.append(ShardPublic(shard=uri, state="committed", rows=committed[stem].rows))
        elif stem in failed:
            items.append(ShardPublic(shard=uri, state="quarantined", error=failed[stem].get("error")))
        else:
            items.append(ShardPublic(shard=uri, state="pending"))
    return items
