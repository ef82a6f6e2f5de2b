"""The audit loop's routes (issue 22; the logic is ``service/audit.py``).

JSON API (``Authorization: Bearer <key>``, the job's tenancy as ``/v1/jobs``):

    GET  /v1/jobs/{id}/audit              the figures (noise rate with its interval, precision and
                                          recall of the noisy flag, reliability, self-agreement)
    GET  /v1/jobs/{id}/audit/next         the next pair to label
    POST /v1/jobs/{id}/audit/labels       {"labels": [{"position", "key", "label"}]}
    GET  /v1/jobs/{id}/audit/labels       ?format=csv|parquet: every label (``pairclean audit --labels`` reads it)
    POST /v1/jobs/{id}/audit/labels:undo  remove the caller's latest label

Pages (session cookie): ``/ui/jobs/{id}/audit`` (the labelling view), with ``next.json``,
``labels.json`` (POST), ``undo.json`` (POST) and ``labels.csv`` under it. The POSTs are
CSRF-safe the way the pages' others are: ``Origin`` / ``Sec-Fetch-Site`` must be this
site, and the body must be ``application/json`` (which no cross-site form can send).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from pairclean.read.shards import MAX_KEY_CHARS

from ..audit import MAX_LABELS_PER_REQUEST, Auditor
from ..charts import reliability_svg
from ..dependencies import Caller, JobId, Store, job_or_404
from .jobs import public_job
from .pages import Viewer, ViewerApi, render_page, same_site

__all__ = ["LabelIn", "LabelsIn", "router"]

router = APIRouter()


class LabelIn(BaseModel):
    """One label: the pair's place in the queue and its key (both must match), and the label."""

    model_config = {"extra": "forbid"}

    position: int = Field(ge=0, le=100_000)
    #: any key a shard may hold (``MAX_KEY_CHARS``, each character at most 4 once escaped as
    #: a ``bad_key``): a longer one was queued and could never be labelled (422), so the page
    #: served that pair for ever
    key: str = Field(min_length=1, max_length=4 * MAX_KEY_CHARS)
    label: Literal["clean", "noisy", "unsure"]


class LabelsIn(BaseModel):
    model_config = {"extra": "forbid"}

    labels: list[LabelIn] = Field(min_length=1, max_length=MAX_LABELS_PER_REQUEST)


def _auditor(request: Request) -> Auditor:
    return request.app.state.auditor  # type: ignore[no-any-return]


# -- JSON API ---------------------------------------------------------------------------------

@router.get("/v1/jobs/{job_id}/audit")
def audit_report(request: Request, job_id: JobId, who: Caller, store: Store) -> dict[str, Any]:
    job = job_or_404(store, job_id, who)
    report = _auditor(request).report(job)
    if report is None:
        raise HTTPException(404, "this job has no audit queue yet: GET .../audit/next draws it")
    return report


@router.get("/v1/jobs/{job_id}/audit/next")
def audit_next(request: Request, job_id: JobId, who: Caller, store: Store) -> dict[str, Any]:
    return _auditor(request).next_item(job_or_404(store, job_id, who), who)


@router.post("/v1/jobs/{job_id}/audit/labels", status_code=201)
def audit_add(request: Request, job_id: JobId, body: LabelsIn, who: Caller, store: Store) -> dict[str, Any]:
    return _auditor(request).add(job_or_404(store, job_id, who), who, [lab.model_dump() for lab in body.labels])


@router.post("/v1/jobs/{job_id}/audit/labels:undo")
def audit_undo(request: Request, job_id: JobId, who: Caller, store: Store) -> dict[str, Any]:
    removed = _auditor(request).undo(job_or_404(store, job_id, who), who)
    return {"removed": removed}


@router.get("/v1/jobs/{job_id}/audit/labels")
def audit_labels(request: Request, job_id: JobId, who: Caller, store: Store,
                 format: Literal["csv", "parquet"] = "csv") -> Response:
    data, media_type = _auditor(request).export(job_or_404(store, job_id, who), format)
    return Response(data, media_type=media_type,
                    headers={"Content-Disposition": f'attachment; filename="audit-labels-{job_id[:8]}.{format}"'})


# -- pages ----------------------------------------------------------------------------------

@router.get("/ui/jobs/{job_id}/audit", response_class=HTMLResponse, include_in_schema=False)
def audit_page(request: Request, job_id: JobId, who: Viewer, store: Store) -> Response:
    job = job_or_404(store, job_id, who)
    auditor = _auditor(request)
    doc = auditor.queue(job)
    assert doc is not None
    report = auditor.report(job, doc)
    return render_page(request, "audit.html", who=who, job=public_job(job), design=doc["design"], report=report,
                   reliability=reliability_svg(report["reliability"]) if report and "reliability" in report else None)


@router.get("/ui/jobs/{job_id}/audit/next.json", include_in_schema=False)
def audit_page_next(request: Request, job_id: JobId, who: ViewerApi, store: Store) -> dict[str, Any]:
    return _auditor(request).next_item(job_or_404(store, job_id, who), who)


async def _json_post(request: Request) -> Any:
    if not same_site(request):
        raise HTTPException(403, "cross-site request refused")
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise HTTPException(415, "send JSON")
    try:
        return await request.json()
    except (ValueError, RecursionError):  # 100 kB of "[[[..." nests past the parser's stack: 500 before
        raise HTTPException(400, "unreadable JSON") from None


@router.post("/ui/jobs/{job_id}/audit/labels.json", include_in_schema=False)
async def audit_page_label(request: Request, job_id: JobId, who: ViewerApi, store: Store) -> dict[str, Any]:
    body = await _json_post(request)
    try:
        item = LabelIn.model_validate(body)
    except ValueError:
        raise HTTPException(422, "a label is {position, key, label} with label clean, noisy or unsure") from None
    job = job_or_404(store, job_id, who)
    auditor = _auditor(request)
    # In the thread pool, as the /v1 routes: the labels' lock (and the store) must never
    # hold the event loop, which answers every other request.
    await run_in_threadpool(auditor.add, job, who, [item.model_dump()])
    return await run_in_threadpool(auditor.next_item, job, who)


@router.post("/ui/jobs/{job_id}/audit/undo.json", include_in_schema=False)
async def audit_page_undo(request: Request, job_id: JobId, who: ViewerApi, store: Store) -> dict[str, Any]:
    await _json_post(request)
    job = job_or_404(store, job_id, who)
    auditor = _auditor(request)
    await run_in_threadpool(auditor.undo, job, who)
    return await run_in_threadpool(auditor.next_item, job, who)


@router.get("/ui/jobs/{job_id}/audit/labels.csv", include_in_schema=False)
def audit_page_export(request: Request, job_id: JobId, who: ViewerApi, store: Store,
                      format: Annotated[Literal["csv", "parquet"], Query()] = "csv") -> Response:
    data, media_type = _auditor(request).export(job_or_404(store, job_id, who), format)
    return Response(data, media_type=media_type,
                    headers={"Content-Disposition": f'attachment; filename="audit-labels-{job_id[:8]}.{format}"'})
