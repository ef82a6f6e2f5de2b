"""Liveness, readiness and Prometheus metrics: no API key needed."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..dependencies import AppMetrics, Runner, Store
from ..schemas import Problem

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:  # on the event loop: no pool thread, however busy the pools are
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": Problem}})
def readyz(store: Store, runner: Runner) -> JSONResponse:
    ok = store.ping() and runner._thread.is_alive()
    return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response)
def prometheus(store: Store, metrics: AppMetrics) -> Response:
    metrics.jobs_by_state(store.counts_by_state())
    return Response(metrics.render(), media_type="text/plain; version=0.0.4")
