"""The REST front end: ``create_app(settings)`` builds a FastAPI app with its own store,
runner and metrics (nothing is built at import time).

Routes: ``POST /v1/jobs``, ``POST /v1/jobs:validate``, ``GET /v1/jobs``,
``GET /v1/jobs/{id}``, ``GET /v1/jobs/{id}/shards``, ``GET /v1/jobs/{id}/logs``,
``POST /v1/jobs/{id}:cancel``, ``POST /v1/jobs/{id}:retry`` (all with
``Authorization: Bearer <key>``), and the unauthenticated ``/healthz``, ``/readyz``, ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import posixpath
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlparse

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, Field
from sqlalchemy.exc import IntegrityError

from pairclean.lifecycle import FAILED, PARTIAL, QUEUED, RUNNING, State

from .guards import BodyLimit, BoundedReader, PrefixEnd, public_errors, safe_text, scrub
from .metrics import Metrics
from .runner import JobRunner
from .security import UriRefused, check_uri, hash_key, local_target
from .settings import ServiceSettings
from .store import TERMINAL, JobRow, JobStore, OutputInUse, Principal

__all__ = ["create_app", "JobRequest", "JobPublic"]

log = logging.getLogger(__name__)

_NAME = r"^[A-Za-z0-9._-]{1,100}$"
#: Text fields hold no NUL, no control characters and no lone surrogates (422 otherwise).
SafeStr = Annotated[str, AfterValidator(safe_text)]


class JobOptions(BaseModel):
    """Optional scoring options (the `pairclean score` flags of the same names)."""

    model_config = {"extra": "forbid", "allow_inf_nan": False}

    batch_size: int | None = Field(None, ge=1, le=4096)
    max_failed_fraction: float | None = Field(None, ge=0, le=1)
    max_retries: int | None = Field(None, ge=0, le=20)
    shard_timeout: float | None = Field(None, gt=0, le=86_400)
    beta_k: int | None = Field(None, ge=2, le=4096)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)


class JobRequest(BaseModel):
    """A scoring job: shard URIs (braces, globs allowed), an output folder and the method."""

    model_config = {"extra": "forbid", "allow_inf_nan": False}

    shards: list[Annotated[SafeStr, Field(min_length=1, max_length=2048)]] = Field(min_length=1, max_length=10_000)
    output: SafeStr = Field(min_length=1, max_length=2048)
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


class StoredRequest(BaseModel):
    """A job's request as stored (rows written before today's checks still read back)."""

    shards: list[str]
    output: str
    estimator: str
    beta_recipe: str
    weighting: str
    options: dict[str, Any] = Field(default_factory=dict)


class JobPublic(BaseModel):
    id: str
    state: State
    request: StoredRequest
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


class JobLogs(BaseModel):
    """A piece of a job's log: ``text`` is bytes ``offset`` to ``next_offset`` of ``size``."""

    text: str
    offset: int
    next_offset: int
    size: int


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
    404: {"model": Problem, "description": "no such job (or not one of the caller's)"},
    409: {"model": Problem, "description": "the job is not in a state that allows this, or another job is writing to the output"},
    413: {"model": Problem, "description": "request too large"},
    422: {"model": Problem, "description": "invalid request (bad URI, refused location, bad field)"},
}


def _seconds_since(iso: str | None) -> float | None:
    if not iso:
        return None
    return max(0.0, (datetime.now(timezone.utc) - datetime.fromisoformat(iso)).total_seconds())


def _public(job: JobRow) -> JobPublic:
    elapsed = _seconds_since(job.started_at) if job.state == RUNNING else None
    rate = job.pairs / elapsed if elapsed and job.pairs else None
    finished = job.shards_done + job.shards_failed
    eta = elapsed / finished * (job.shards_total - finished) if elapsed and finished else None
    request = scrub(job.request)
    return JobPublic(
        id=job.id, state=job.state, request=StoredRequest.model_validate(request),  # type: ignore[arg-type]
        progress=Progress(shards_total=job.shards_total, shards_done=job.shards_done, shards_failed=job.shards_failed,
                          pairs=job.pairs, pairs_per_s=rate, eta_s=eta),
        noise_rate_estimate=job.noise_rate, output=request["output"], error=scrub(job.error),
        created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
    )


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


def output_key(output: str) -> str:
    """The identity of an output location (two spellings of one folder share it)."""
    try:
        target = local_target(output)
    except UriRefused:  # a row stored before today's checks: its spelling is its identity
        target = output
    if target is None:
        parsed = urlparse(output)
        target = f"{parsed.scheme.lower()}://{parsed.netloc.lower()}{posixpath.normpath(unquote(parsed.path) or '/')}"
    return hashlib.sha256(target.rstrip("/").encode("utf-8", "replace")).hexdigest()


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
        validate_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pairclean", version="0.1.0", lifespan=lifespan, responses=_ERRORS)
    app.state.store, app.state.runner, app.state.metrics, app.state.settings = store, runner, metrics, settings
    # Validations read shards: their own small pool, so slow or many of them never take
    # the threads that serve /healthz, /metrics and the job routes.
    validate_pool = ThreadPoolExecutor(max_workers=settings.validate_concurrency, thread_name_prefix="pairclean-validate")
    validate_slots = threading.BoundedSemaphore(settings.validate_concurrency)

    @app.middleware("http")
    async def metrics_middleware(request: Request, call_next: Any) -> Response:
        started = time.perf_counter()
        response: Response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")  # bounded: route templates, not raw paths
        metrics.requests.labels(route=name, code=f"{response.status_code // 100}xx").inc()
        metrics.latency.labels(route=name).observe(time.perf_counter() - started)
        return response

    # Outermost (added last): bodies are bounded before metrics, authentication or routing.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": public_errors(list(exc.errors()))}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse({"detail": "internal error"}, status_code=500)  # never a stack trace

    def job_or_404(job_id: str, who: Principal) -> JobRow:
        job = store.get(job_id)
        if job is None or not (who.admin or job.owner == who.name):
            # Another owner's job is answered exactly like a missing one.
            raise HTTPException(404, f"no job {job_id!r}")
        return job

    def expand(request: JobRequest) -> list[str]:
        """Allow-list every location before it is touched and expand the shards; 422 otherwise."""
        from pairclean.errors import PaircleanError
        from pairclean.uris import expand_shards

        def allowed_input(uri: str) -> None:
            check_uri(uri, settings.allowed_inputs, settings.allow_pipe)

        try:
            for spec in request.shards:
                if "#" in spec:  # the runner passes specs through an @list file, where '#' starts a comment
                    raise UriRefused(f"{spec!r}: '#' is not accepted in shard URIs")
                allowed_input(spec[1:] if spec.startswith("@") else spec)
            check_uri(request.output, settings.allowed_outputs)
            target = local_target(request.output)
            if target is not None and os.path.exists(target) and not os.path.isdir(target):
                raise UriRefused(f"output {request.output!r} exists and is not a folder")
            # The check runs on every list file, glob and shard before it is opened or
            # listed, so nothing outside the allow-list is touched or reported on.
            return expand_shards(request.shards, max_shards=settings.max_shards, check=allowed_input)
        except UriRefused as exc:
            raise HTTPException(422, str(exc)) from exc
        except PaircleanError as exc:
            raise HTTPException(422, str(exc)) from exc

    def checked(request: JobRequest) -> int:
        """Allow-list every URI and count the shards; 422 with the reason otherwise."""
        return len(expand(request))

    def validate_blocking(request: JobRequest) -> Validation:
        """Expand the shards and read a bounded prefix of the first (bytes, seconds, samples)."""
        from pairclean.errors import PaircleanError
        from pairclean.shards import DEFAULT_MAX_MEMBER_BYTES, ReadOptions, iter_pairs_from
        from pairclean.uris import open_shard

        shards = expand(request)
        first = shards[0]
        statuses: dict[str, int] = {}
        problems: list[str] = []
        samples = 0
        deadline = time.monotonic() + settings.validate_timeout_s
        options = ReadOptions(max_member_bytes=min(DEFAULT_MAX_MEMBER_BYTES, settings.validate_max_bytes))
        reader: BoundedReader | None = None
        try:
            with open_shard(first, http_allowed=settings.allowed_inputs) as fh:
                reader = BoundedReader(fh, settings.validate_max_bytes, deadline)
                for pair in iter_pairs_from(reader, first, options):  # type: ignore[arg-type]
                    samples += 1
                    statuses[pair.status] = statuses.get(pair.status, 0) + 1
                    if pair.status != "ok" and len(problems) < 20:
                        problems.append(f"{pair.key}: {pair.status} ({pair.error})")
                    if samples >= settings.validate_max_samples:
                        problems.append(f"stopped after the first {samples} samples")
                        break
        except PrefixEnd:
            limit = f"{settings.validate_max_bytes} bytes" if reader and reader.reason == "bytes" else f"{settings.validate_timeout_s:g} s"
            problems.append(f"read only the first {limit} of {first!r}")
        except PaircleanError as exc:
            problems.append(str(exc))
        return Validation(shards=len(shards), first_shard=first, samples=samples, statuses=statuses, problems=problems)

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
               idempotency_key: Annotated[str | None, Header(max_length=200, pattern=r"^[\x21-\x7e]{1,200}$")] = None) -> JobPublic:
        if idempotency_key:  # a repeat returns the job before any check (the shards may have moved since)
            existing = store.by_idempotency_key(idempotency_key, who.name)
            if existing is not None:
                response.status_code = 200
                return _public(existing)
        total = checked(request)
        try:
            job, created = store.create(request.model_dump(), who.name, idempotency_key, total, output_key(request.output))
        except OutputInUse as exc:
            raise HTTPException(409, f"job {exc.job_id} is already writing to {request.output!r}; wait for it or cancel it") from exc
        if not created:
            response.status_code = 200
        return _public(job)

    @app.post("/v1/jobs:validate", response_model=Validation,
              responses={429: {"model": Problem, "description": "too many validations in progress"},
                         504: {"model": Problem, "description": "the shard did not answer in time"}})
    async def validate(request: JobRequest, who: Caller) -> Validation:
        if not validate_slots.acquire(blocking=False):
            raise HTTPException(429, "too many validations in progress; retry later", headers={"Retry-After": "5"})
        future = asyncio.get_running_loop().run_in_executor(validate_pool, validate_blocking, request)
        # The slot is freed when the read really ends, not when this request gives up on it.
        future.add_done_callback(lambda _: validate_slots.release())
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=settings.validate_timeout_s + 5)
        except asyncio.TimeoutError:
            raise HTTPException(504, f"the first shard did not answer within {settings.validate_timeout_s:g} s") from None

    @app.get("/v1/jobs", response_model=JobPage)
    def list_jobs(who: Caller, limit: Annotated[int, Query(ge=1, le=500)] = 50, offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
                  state: State | None = None) -> JobPage:
        rows, total = store.list(limit, offset, state, owner=None if who.admin else who.name)
        return JobPage(items=[_public(r) for r in rows], total=total, limit=limit, offset=offset)

    @app.get("/v1/jobs/{job_id}", response_model=JobPublic)
    def get_job(job_id: JobId, who: Caller) -> JobPublic:
        return _public(job_or_404(job_id, who))

    @app.get("/v1/jobs/{job_id}/shards", response_model=ShardPage)
    def job_shards(job_id: JobId, who: Caller, state: Literal["committed", "quarantined", "pending"] | None = None,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 100, offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> ShardPage:
        job = job_or_404(job_id, who)
        items = [s for s in _shard_states(job) if state is None or s.state == state]
        return ShardPage(items=items[offset : offset + limit], total=len(items), limit=limit, offset=offset)

    @app.get("/v1/jobs/{job_id}/logs", response_model=JobLogs)
    def job_logs(job_id: JobId, who: Caller, offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
                 limit: Annotated[int, Query(ge=1, le=LOG_PAGE_BYTES)] = LOG_PAGE_BYTES) -> JobLogs:
        """The job process's output (what the runner's replica wrote), a page at a time."""
        job = job_or_404(job_id, who)
        return read_log(runner.logs / f"{job.id}.log", offset, limit)

    @app.post("/v1/jobs/{job_id}:cancel", response_model=JobPublic)
    def cancel(job_id: JobId, who: Caller) -> JobPublic:
        job = job_or_404(job_id, who)
        if job.state in TERMINAL:
            raise HTTPException(409, f"job is {job.state}")
        runner.cancel(job)
        return _public(job_or_404(job_id, who))

    @app.post("/v1/jobs/{job_id}:retry", response_model=JobPublic)
    def retry(job_id: JobId, who: Caller) -> JobPublic:
        job = job_or_404(job_id, who)
        # Rerunning the same command resumes: only the failed (uncommitted) shards are redone.
        try:
            moved = store.transition(job_id, [PARTIAL, FAILED], state=QUEUED, error=None, finished_at=None, cancel_requested=0,
                                     output_key=output_key(job.request["output"]))
        except IntegrityError:
            holder = store.active_on_output(output_key(job.request["output"]))
            raise HTTPException(409, f"job {holder.id if holder else '?'} is already writing to this job's output; "
                                     "wait for it or cancel it") from None
        if not moved:
            raise HTTPException(409, f"only PARTIAL or FAILED jobs can be retried; this one is {job.state}")
        return _public(job_or_404(job_id, who))

    return app


#: The most log bytes one ``/logs`` reply carries (the client pages through the rest).
LOG_PAGE_BYTES = 1 << 20


def read_log(path: Path, offset: int, limit: int) -> JobLogs:
    """Bytes ``offset``..``offset + limit`` of a log file as text, ending on a whole UTF-8
    character (a character cut by the page end, or still being written, comes next time).
    A job that has not started has an empty log."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(min(offset, size))
            data = fh.read(limit)
    except FileNotFoundError:
        return JobLogs(text="", offset=offset, next_offset=offset, size=0)
    start = min(offset, size)
    for cut in range(min(4, len(data) + 1)):  # a UTF-8 character is at most 4 bytes
        try:
            text = data[: len(data) - cut].decode("utf-8")
            return JobLogs(text=text, offset=start, next_offset=start + len(data) - cut, size=size)
        except UnicodeDecodeError:
            continue
    # Not UTF-8 at all (a binary write): replaced characters, but the log still moves on.
    return JobLogs(text=data.decode("utf-8", "replace"), offset=start, next_offset=start + len(data), size=size)


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
