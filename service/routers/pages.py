"""``/ui``: web pages for data teams, server-rendered (Jinja2) with SVG charts drawn here.

    GET  /ui/login, POST /ui/login     exchange an API key for a session cookie
    POST /ui/logout                    end the session
    GET  /ui/jobs                      the caller's jobs, progress polled from /ui/jobs.json
    GET  /ui/jobs/{id}                 charts, counts, spec and calibration ("why was this flagged")
    GET  /ui/jobs/{id}/gallery         lowest-weight and borderline pairs, paged
    GET  /ui/jobs/{id}/shards/{stem}   one shard's rows, filtered
    GET  /ui/jobs/{id}/thumbs/{stem}/{row}   a downscaled image (or a placeholder)

Same tenancy as ``/v1/jobs``: a session resolves to its API key's owner and every job goes
through ``job_or_404`` (another owner's job is a 404, admins see all). Security: the
cookie is HttpOnly and SameSite=Strict (Secure over HTTPS); the only state-changing
routes are POSTs whose ``Origin`` / ``Sec-Fetch-Site`` must be this site (login CSRF too);
templates autoescape; every page carries a Content-Security-Policy with no inline script
or style and ``nosniff``; page sizes are fixed and query filters validated.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from importlib import resources
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, quote, urlencode

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pairclean import schema
from pairclean.job.lifecycle import TERMINAL, State
from pairclean.output.report import junk_gap, mixture_noise, noisy_rule_of

from ..browse import GALLERY_MAX, PAGE_SIZE, Browser, JobOverview, RowFilter
from ..charts import Series, histogram_svg, reliability_svg
from ..dependencies import JobId, Store, job_or_404
from ..guards import public_errors
from ..schemas import JobPublic
from ..security import hash_key
from ..sessions import COOKIE, Sessions
from ..settings import ServiceSettings
from ..store import Principal
from .jobs import public_job, read_output_facts

__all__ = ["router", "install", "DEMO_IDEMPOTENCY_KEY", "render_page", "same_site"]

router = APIRouter(include_in_schema=False)

#: The idempotency key of the job ``pairclean serve --demo`` queues (owner ``demo``).
DEMO_IDEMPOTENCY_KEY = "pairclean-demo"
#: Jobs on one page of the job list; shards on one page of a job's shard table.
JOBS_PAGE = 50
SHARDS_PAGE = 50
_STATIC = {"pages.css": "text/css; charset=utf-8", "pages.js": "text/javascript; charset=utf-8", "audit.js": "text/javascript; charset=utf-8",
           "favicon.svg": "image/svg+xml"}
#: The pages' policy (``guards.SecurityHeaders`` puts it on every reply under / and /ui).
PAGE_CSP = ("default-src 'none'; img-src 'self'; style-src 'self'; script-src 'self'; connect-src 'self'; "
            "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
_COLOURS = {"clean": "#4c9a6a", "noisy": "#c8553d"}


class LoginRequired(Exception):
    """A page was asked for without a live session: answered with a redirect to the login."""

    def __init__(self, next_path: str) -> None:
        super().__init__("login required")
        self.next_path = next_path


def install(app: FastAPI, settings: ServiceSettings) -> None:
    """Add the pages to ``app``: routes, sessions, the page data reader, headers and
    HTML error pages for ``/ui`` (other paths keep their JSON errors)."""
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    templates = resources.files("pairclean_service") / "templates"
    app.state.templates = Environment(loader=FileSystemLoader(str(templates)), autoescape=True, undefined=StrictUndefined)
    app.state.sessions = Sessions(settings.ui_session_ttl_s)
    app.state.browser = Browser(settings)
    app.include_router(router)
    json_errors = app.exception_handlers.get(StarletteHTTPException)
    invalid = app.exception_handlers.get(RequestValidationError)

    @app.exception_handler(LoginRequired)
    async def to_login(_: Request, exc: LoginRequired) -> Response:
        return RedirectResponse(f"/ui/login?{urlencode({'next': exc.next_path})}", status_code=303)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if _is_page(request):
            return _render(request, "error.html", exc.status_code, who=None, title=f"{exc.status_code}", message=str(exc.detail))
        if json_errors is not None:
            return await json_errors(request, exc)  # type: ignore[no-any-return]
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, exc: RequestValidationError) -> Response:
        if _is_page(request):
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in public_errors(list(exc.errors())))
            return _render(request, "error.html", 422, who=None, title="Invalid request", message=problems)
        assert invalid is not None
        return await invalid(request, exc)  # type: ignore[no-any-return]

def _is_page(request: Request) -> bool:
    path = request.url.path
    return path.startswith("/ui") and not path.endswith(".json")


# -- who is looking ------------------------------------------------------------------------------

def _principal(request: Request) -> Principal | None:
    settings: ServiceSettings = request.app.state.settings
    if not settings.require_auth:
        return Principal("anonymous")
    key_hash = request.app.state.sessions.key_hash(request.cookies.get(COOKIE))
    # Resolved through the store on every request: a key removed there ends its sessions.
    return request.app.state.store.principal(key_hash) if key_hash else None  # type: ignore[no-any-return]


def viewer(request: Request) -> Principal:
    """The session's owner; a page without one redirects to the login."""
    who = _principal(request)
    if who is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(target)
    return who


def viewer_api(request: Request) -> Principal:
    """The session's owner; JSON and images without one get 401."""
    who = _principal(request)
    if who is None:
        raise HTTPException(401, "log in at /ui/login")
    return who


Viewer = Annotated[Principal, Depends(viewer)]
ViewerApi = Annotated[Principal, Depends(viewer_api)]


def _browser(request: Request) -> Browser:
    return request.app.state.browser  # type: ignore[no-any-return]


Pages = Annotated[Browser, Depends(_browser)]


def _same_site(request: Request) -> bool:
    """Whether a POST comes from this site's own pages (CSRF and login CSRF): browsers send
    ``Sec-Fetch-Site`` and ``Origin`` with every cross-site form post."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True  # a non-browser client (no ambient cookies to abuse)
    host = request.headers.get("host", "")
    return origin in (f"http://{host}", f"https://{host}")


#: For the routers that add pages of their own (``routers/audit.py``).
same_site = _same_site


def _safe_next(value: str | None) -> str:
    """A local page to return to after logging in (never another site: no open redirect)."""
    path = (value or "").split("?")[0]
    if value and path.startswith("/ui/") and "//" not in value and "\\" not in value and len(value) <= 512 \
            and value.isprintable() and not path.startswith("/ui/login") and not {".", ".."} & set(path.split("/")):
        return value
    return "/ui/jobs"


# -- rendering -------------------------------------------------------------------------------

def _render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    settings: ServiceSettings = request.app.state.settings
    context.setdefault("progress_url", None)
    context.setdefault("reload_on_end", False)
    html = request.app.state.templates.get_template(name).render(
        auth=settings.require_auth, poll_ms=settings.ui_poll_ms, fmt=_fmt, pct=_pct, quote=_q, **context)
    return HTMLResponse(html, status_code=status)


render_page = _render


def _q(value: str) -> str:
    """A path segment, percent-encoded (stems may hold any character a file name can)."""
    return quote(value, safe="")


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_fields(job: JobPublic) -> dict[str, str]:
    """A job's progress as the pages print it (the polling script swaps these texts in)."""
    p = job.progress
    rate = p.pairs_per_s
    if rate is None and job.state in TERMINAL and job.started_at and job.finished_at and p.pairs:
        # The REST status gives a rate while running; a finished job shows its average.
        seconds = (datetime.fromisoformat(job.finished_at) - datetime.fromisoformat(job.started_at)).total_seconds()
        rate = p.pairs / seconds if seconds > 0 else None
    return {
        "state": job.state,
        "shards": f"{p.shards_done} / {p.shards_total}",
        "failed": str(p.shards_failed),
        "pairs": f"{p.pairs:,}",
        "rate": "n/a" if rate is None else f"{rate:,.1f} pairs/s",
        "eta": "done" if job.state in TERMINAL else _duration(p.eta_s),
        "noise": _pct(job.noise_rate_estimate),
    }


def _age(iso: str | None) -> str:
    if not iso:
        return ""
    try:
        seconds = (datetime.now(timezone.utc) - datetime.fromisoformat(iso)).total_seconds()
    except ValueError:
        return iso
    return f"{_duration(max(seconds, 0))} ago"


# -- login -----------------------------------------------------------------------------------

@router.get("/")
@router.get("/ui")
@router.get("/ui/")
def home() -> RedirectResponse:
    return RedirectResponse("/ui/jobs", status_code=303)


@router.get("/ui/login", response_class=HTMLResponse)
def login_page(request: Request, next: Annotated[str, Query(max_length=512)] = "") -> Response:  # noqa: A002 - the query's name
    if _principal(request) is not None:
        return RedirectResponse(_safe_next(next), status_code=303)
    return _render(request, "login.html", who=None, next=_safe_next(next), error=None)


@router.post("/ui/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    if not _same_site(request):
        raise HTTPException(403, "cross-site login refused")
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        raise HTTPException(415, "send the login form")
    # The body is already bounded (BodyLimit); parsed here rather than with FastAPI's Form,
    # which needs python-multipart for two text fields.
    try:
        form = parse_qs((await request.body()).decode("utf-8"), max_num_fields=4, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        raise HTTPException(400, "unreadable form") from None
    key = (form.get("api_key") or [""])[0].strip()
    next_path = _safe_next((form.get("next") or [""])[0])
    key_hash = hash_key(key) if key and len(key) <= 200 else None
    if key_hash is None or request.app.state.store.principal(key_hash) is None:
        return _render(request, "login.html", 401, who=None, next=next_path, error="That API key is not valid.")
    settings: ServiceSettings = request.app.state.settings
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(COOKIE, request.app.state.sessions.create(key_hash), max_age=int(settings.ui_session_ttl_s), path="/ui",
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return response


@router.post("/ui/logout")
def logout(request: Request) -> Response:
    if not _same_site(request):
        raise HTTPException(403, "cross-site logout refused")
    request.app.state.sessions.end(request.cookies.get(COOKIE))
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response


@router.get("/ui/static/{name}")
def static(name: str) -> Response:
    """The pages' stylesheet, script and icon (no data: served without a session, so the
    login page is styled too). A fixed list: no path reaches the file system."""
    if name not in _STATIC:
        raise HTTPException(404, "no such file")
    data = (resources.files("pairclean_service") / "static" / name).read_bytes()
    return Response(data, media_type=_STATIC[name], headers={"Cache-Control": "public, max-age=3600"})


# -- jobs ------------------------------------------------------------------------------------

def _job_page(who: Principal, store: Any, state: State | None, offset: int) -> tuple[list[JobPublic], int]:
    rows, total = store.list(JOBS_PAGE, offset, state, owner=None if who.admin else who.name)
    return [public_job(r) for r in rows], total


@router.get("/ui/jobs", response_class=HTMLResponse)
def jobs_page(request: Request, who: Viewer, store: Store, state: State | None = None,
              offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> Response:
    jobs, total = _job_page(who, store, state, offset)
    query = urlencode({k: v for k, v in (("state", state), ("offset", offset)) if v})
    return _render(request, "jobs.html", who=who, jobs=[(j, progress_fields(j), _age(j.created_at)) for j in jobs],
                   total=total, offset=offset, page=JOBS_PAGE, state=state or "", states=list(State.__args__),  # type: ignore[attr-defined]
                   progress_url=f"/ui/jobs.json?{query}" if any(j.state not in TERMINAL for j in jobs) else None)


@router.get("/ui/jobs.json")
def jobs_progress(who: ViewerApi, store: Store, state: State | None = None, offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> dict[str, Any]:
    jobs, _ = _job_page(who, store, state, offset)
    return {"items": [{"id": j.id, "state": j.state, "fields": progress_fields(j)} for j in jobs]}


@router.get("/ui/demo")
def demo(who: Viewer, store: Store) -> RedirectResponse:
    """The job ``pairclean serve --demo`` queued for the logged-in owner (``demo``)."""
    job = store.by_idempotency_key(DEMO_IDEMPOTENCY_KEY, who.name)
    if job is None:
        raise HTTPException(404, "no demo job here: start the service with `pairclean serve --demo` and log in with the key it prints")
    return RedirectResponse(f"/ui/jobs/{job.id}", status_code=303)


@router.get("/ui/jobs/{job_id}/progress.json")
def job_progress(job_id: JobId, who: ViewerApi, store: Store) -> dict[str, Any]:
    job = public_job(job_or_404(store, job_id, who))
    return {"items": [{"id": job.id, "state": job.state, "fields": progress_fields(job)}]}


@router.get("/ui/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: JobId, who: Viewer, store: Store, pages: Pages,
             shard_offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> Response:
    row, _ = read_output_facts(request, store, job_or_404(store, job_id, who))  # an audit's noise rate, once applied
    job = public_job(row)
    view = pages.overview(row)
    audit = request.app.state.auditor.report(row) if request.app.state.store.count_labels(row.id) else None
    return _render(request, "job.html", who=who, job=job, fields=progress_fields(job), view=view, charts=_charts(view), audit=audit,
                   reliability=reliability_svg(audit["reliability"]) if audit and "reliability" in audit else None,
                   can_audit=job.state in TERMINAL and view.committed > 0,
                   why=_why(view), shards=view.scanned[shard_offset : shard_offset + SHARDS_PAGE], shard_offset=shard_offset,
                   shards_page=SHARDS_PAGE, model=view.meta.get("model") or {},
                   quarantined=sorted(view.quarantined.items())[:SHARDS_PAGE],
                   progress_url=None if job.state in TERMINAL else f"/ui/jobs/{job.id}/progress.json", reload_on_end=True)


def _charts(view: JobOverview) -> dict[str, Any]:
    charts: dict[str, Any] = {}
    if view.sim_edges:
        beta = view.beta
        charts["similarity"] = histogram_svg(
            view.sim_edges, [Series("clean", view.sim_clean, _COLOURS["clean"]), Series("noisy (≤ β)", view.sim_noisy, _COLOURS["noisy"])],
            "Similarity of the ok pairs, with beta", "cosine similarity", marker=beta,
            marker_label=f"β = {beta:+.3f}" if beta is not None else "")
        edges = [i / 20 for i in range(21)]
        charts["weight"] = histogram_svg(
            edges, [Series("clean", view.weight_clean, _COLOURS["clean"]), Series("noisy (≤ β)", view.weight_noisy, _COLOURS["noisy"])],
            "Weight of the ok pairs", "weight (β maps to 0)", marker=0.0, marker_label="β")
    return charts


_FORMULAS = {
    "p-clean": "w = p_clean: P(clean) under the corpus mixture of clean, random-mismatch and near-miss similarities (and the judge's word check where it ran; an audit's recalibration where one was applied); the noisy flag reads the similarity against β and p_clean ≤ 0.5, so a pair may be flagged at a weight a little above 0.5",
    "paper": "w = 27/4 · d² · (1 − d) with d = similarity − β for d > 0, else 0 (the paper's eq. 5, rescaled to [0, 1])",
    "reference": "w = 4x²(1 − x²) with x = clamp((similarity − β) / d_ref, 0, 1) (the released code's curve, one dataset-level d_ref)",
    "reference-batch": "per batch of consecutive pairs, x = d⁺ / max(d⁺) and w = x²(1 − x²) (the released code exactly)",
}


def _why(view: JobOverview) -> dict[str, Any]:
    """What decided the flags: beta, its recipe, the weighting and the noisy rule."""
    cal, meta = view.calibration, view.meta
    refine = meta.get("refine")
    weighting = cal.weighting if cal else (meta.get("weighting") or {}).get("name")
    return {
        "beta": cal.beta if cal else None,
        "recipe": cal.recipe if cal else None,
        "k": cal.k if cal else None,
        "seed": cal.seed if cal else None,
        "calibration_pairs": cal.calibration_pairs if cal else None,
        "noise_rate": cal.noise_rate if cal else None,
        "weighting": weighting,
        "d_ref": cal.d_ref if cal else None,
        "formula": _FORMULAS.get(weighting or "", ""),
        "noisy_rule": noisy_rule_of(meta),
        "refine": refine.get("method") if isinstance(refine, dict) else None,
        "contrast_rows": (cal.extra.get("contrast") or {}).get("bank_rows") if cal else None,
        "owner_odds": (cal.extra.get("contrast") or {}).get("owner_odds") if cal else None,
        "shared_p_clean": (cal.extra.get("contrast") or {}).get("shared_p_clean") if cal else None,
        "repeat_max_words": (cal.extra.get("contrast") or {}).get("repeat_max_words") if cal else None,
        "repeat_carriers": (cal.extra.get("contrast") or {}).get("repeat_carriers") if cal else None,
        "caption_floor": (cal.extra.get("contrast") or {}).get("caption_floor") if cal else None,
        "random_fit": (cal.extra.get("contrast") or {}).get("random_fit") if cal else None,
        "mixture_noise": mixture_noise(cal.extra if cal else {}),
        # as `pairclean inspect` and the REST job read it (the first table's metadata): none once
        # an audit recalibrated p_clean, the warning's remedy
        "unexplained_random": junk_gap(meta),
        "judge": cal.extra.get("judge") if cal else None,
    }


@router.get("/ui/jobs/{job_id}/gallery", response_class=HTMLResponse)
def gallery(request: Request, job_id: JobId, who: Viewer, store: Store, pages: Pages,
            kind: Literal["lowest", "borderline"] = "lowest",
            page: Annotated[int, Query(ge=1, le=GALLERY_MAX // PAGE_SIZE)] = 1) -> Response:
    row = job_or_404(store, job_id, who)
    view = pages.overview(row)
    refs = view.lowest if kind == "lowest" else view.border
    items = pages.pairs(row, refs[(page - 1) * PAGE_SIZE : page * PAGE_SIZE])
    return _render(request, "gallery.html", who=who, job=public_job(row), view=view, kind=kind, page=page, items=items,
                   pages=max(1, -(-len(refs) // PAGE_SIZE)), first_rank=(page - 1) * PAGE_SIZE + 1)


@router.get("/ui/jobs/{job_id}/shards/{stem}", response_class=HTMLResponse)
def shard_page(request: Request, job_id: JobId, stem: Annotated[str, PathParam(max_length=512)], who: Viewer, store: Store, pages: Pages,
               status: Annotated[str, Query(max_length=32)] = "", noisy: Literal["", "yes", "no"] = "",
               weight_min: Annotated[float, Query(ge=0, le=1)] = 0.0, weight_max: Annotated[float, Query(ge=0, le=1)] = 1.0,
               offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> Response:
    row = job_or_404(store, job_id, who)
    record = pages.record(row, stem)
    if record is None:
        raise HTTPException(404, "this job has no committed shard of that name")
    if status and status not in schema.STATUSES:
        raise HTTPException(422, f"status must be one of {', '.join(schema.STATUSES)}")
    filters = RowFilter(status or None, {"yes": True, "no": False}.get(noisy), weight_min, weight_max)
    items, total = pages.shard_rows(row, record, filters, offset, PAGE_SIZE)
    query = {"status": status, "noisy": noisy, "weight_min": weight_min, "weight_max": weight_max}
    return _render(request, "shard.html", who=who, job=public_job(row), record=record, items=items, total=total, offset=offset,
                   page=PAGE_SIZE, filters=query, statuses=schema.STATUSES, query=urlencode(query))


@router.get("/ui/jobs/{job_id}/thumbs/{stem}/{row}")
async def thumbnail(job_id: JobId, stem: Annotated[str, PathParam(max_length=512)], row: Annotated[int, PathParam(ge=0, le=2**40)],
                    who: ViewerApi, store: Store, pages: Pages) -> Response:
    """A downscaled image of one row of one of the job's committed shards; a placeholder
    (still an image) when it is missing, refused or unreadable. Runs on the thumbnail
    pool, within its deadline (``browse.ThumbnailPool``): 503 when too many are in
    flight, 504 past the deadline; the shared request threads are never held."""

    def work(deadline: float) -> tuple[bytes, str, str]:
        job = job_or_404(store, job_id, who)
        record = pages.record(job, stem)  # the shard comes from the job's own records, never from the URL
        if record is None:
            raise HTTPException(404, "this job has no committed shard of that name")
        return pages.thumbnail(job, record, row, deadline)

    data, media_type, what = await pages.thumbs.run(work)
    return Response(data, media_type=media_type, headers={"Cache-Control": "private, max-age=300", "X-Pairclean-Image": what})
