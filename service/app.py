"""The REST front end: ``create_app(settings)`` builds a FastAPI app with its own store,
runner and metrics (nothing is built at import time).

Laid out the way FastAPI projects are: ``schemas`` (request and response bodies),
``dependencies`` (the caller, the store, the runner...), ``routers/jobs.py``
(``POST /v1/jobs``, ``POST /v1/jobs:validate``, ``GET /v1/jobs``, ``GET /v1/jobs/{id}``,
``/shards``, ``/logs``, ``:cancel``, ``:retry``, all with ``Authorization: Bearer <key>``)
and ``routers/health.py`` (the unauthenticated ``/healthz``, ``/readyz``, ``/metrics``);
``routers/pages.py`` adds the web pages under ``/ui`` (session login, HTML errors there);
``routers/audit.py`` the audit loop's API and labelling page (``audit.py``);
this module wires them together with the middleware and error handlers.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pairclean.errors import InputError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .dependencies import ValidationPool, output_key
from .guards import BodyLimit, SecurityHeaders, public_errors, redact_access_log
from .metrics import REFUSED_BODY_ROUTE, Metrics
from .audit import Auditor
from .routers import audit, health, jobs, pages
from .routers.jobs import read_log
from .runner import JobRunner
from .schemas import ERRORS, JobPublic, JobRequest
from .security import OutputMoved
from .settings import ServiceSettings
from .store import JobStore

__all__ = ["create_app", "JobRequest", "JobPublic", "output_key", "read_log"]

log = logging.getLogger(__name__)


def create_app(settings: ServiceSettings | None = None, state_dir: str | Path = "pairclean-service") -> FastAPI:
    """Build the app; the runner starts with the app's lifespan and stops with it."""
    settings = settings or ServiceSettings()
    redact_access_log()  # before uvicorn logs a request: keys in query strings stay out of logs
    store = JobStore(settings.database_url)
    metrics = Metrics()
    runner = JobRunner(store, settings, metrics, Path(state_dir))
    validations = ValidationPool.of(settings.validate_concurrency)
    expansions = ValidationPool.of(settings.submit_concurrency, "pairclean-expand")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        runner.stop()
        validations.pool.shutdown(wait=False, cancel_futures=True)
        expansions.pool.shutdown(wait=False, cancel_futures=True)
        app.state.browser.thumbs.close()

    # No Swagger UI or ReDoc: FastAPI serves them from a CDN, unpinned, on this origin, where a
    # changed bundle could read the pages with the labeller's cookie. The schema stays at
    # /openapi.json for any client or viewer run elsewhere.
    app = FastAPI(title="pairclean", version="0.1.0", lifespan=lifespan, responses=ERRORS, docs_url=None, redoc_url=None)
    app.state.store, app.state.runner, app.state.metrics, app.state.settings = store, runner, metrics, settings
    app.state.validations, app.state.expansions = validations, expansions
    app.include_router(health.router)
    app.include_router(jobs.router)
    _add_middleware(app, settings, metrics)
    _add_error_handlers(app)
    pages.install(app, settings)  # after the JSON error handlers, which it keeps outside /ui
    app.state.auditor = Auditor(settings, store, app.state.browser, metrics)
    app.include_router(audit.router)
    return app


def _add_middleware(app: FastAPI, settings: ServiceSettings, metrics: Metrics) -> None:
    @app.middleware("http")
    async def metrics_middleware(request: Request, call_next: Any) -> Response:
        started = time.perf_counter()
        code = 500  # an exception that reaches here becomes a 500 (the outer error handler)
        try:
            response: Response = await call_next(request)
            code = response.status_code
            return response
        finally:  # counted either way: a panel of errors must see the 500s too
            route = request.scope.get("route")
            name = getattr(route, "path", "unmatched")  # bounded: route templates, not raw paths
            metrics.requests.labels(route=name, code=f"{code // 100}xx").inc()
            metrics.latency.labels(route=name).observe(time.perf_counter() - started)

    app.add_middleware(SecurityHeaders, page_policy=pages.PAGE_CSP)
    # Outermost (added last; pages.install adds none): bodies are bounded before metrics,
    # authentication or routing.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       on_refused=lambda code: metrics.requests.labels(route=REFUSED_BODY_ROUTE, code=f"{code // 100}xx").inc())


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": public_errors(list(exc.errors()))}, status_code=422)

    @app.exception_handler(OutputMoved)
    @app.exception_handler(InputError)  # a job's file that resolves outside its own folders (OutputDir roots)
    async def output_moved(request: Request, exc: Exception) -> Response:
        # As a 409 HTTPException, through whichever handler renders those here (the pages'
        # HTML under /ui, JSON elsewhere), looked up when it happens.
        handler = app.exception_handlers[StarletteHTTPException]
        return await handler(request, StarletteHTTPException(409, str(exc)))  # type: ignore[no-any-return]

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse({"detail": "internal error"}, status_code=500)  # never a stack trace
