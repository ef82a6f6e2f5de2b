"""``/v1/jobs``: submit, validate, list, get, shards, logs, cancel, retry (all need an API key;
a job is visible to its owner and to admins only)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.exc import IntegrityError

from pairclean import schema
from pairclean.errors import PaircleanError, first_line
from pairclean.job.lifecycle import FAILED, PARTIAL, QUEUED, RUNNING, TERMINAL, State

from ..dependencies import Caller, Expansions, JobId, Runner, Settings, Store, Validations, job_or_404, output_key
from ..guards import BoundedReader, PrefixEnd, scrub
from ..security import UriRefused, check_uri, checked_output, job_roots, local_target, output_location
from ..settings import ServiceSettings
from ..store import JobRow, JobStore, OutputInUse, Principal
from ..schemas import (
    JobLogs, JobPage, JobPublic, JobRequest, Problem, Progress, ShardPage, ShardPublic, StoredRequest, Validation,
)

__all__ = ["router", "read_log", "LOG_PAGE_BYTES"]

_log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")

#: Held while a submission or retry counts the caller's queue share and inserts its job.
_SUBMITTING = threading.Lock()
#: The most log bytes one ``/logs`` reply carries (the client pages through the rest).
LOG_PAGE_BYTES = 1 << 20


@router.post("/jobs", status_code=201, response_model=JobPublic,
             responses={429: {"model": Problem, "description": "the caller has as many queued jobs as one owner may, "
                                                                "or too many submissions are being checked"}})
async def submit(request: JobRequest, who: Caller, response: Response, store: Store, settings: Settings,
                 expansions: Expansions,
                 idempotency_key: Annotated[str | None, Header(max_length=200, pattern=r"^[\x21-\x7e]{1,200}$")] = None) -> JobPublic:
    if idempotency_key:  # a repeat returns the job before any check (the shards may have moved since)
        existing = await run_in_threadpool(store.by_idempotency_key, idempotency_key, who.name)
        if existing is not None:
            response.status_code = 200
            return public_job(existing)
    # Expanding is bounded in time (validate_timeout_s) but not cheap: in the threads that
    # serve every route, 42 slow specs at once held /healthz and other tenants for 8 s.
    shards = await expansions.run(settings.validate_timeout_s, "too many submissions are being checked; retry later",
                                  expand, request, settings)
    job, created = await run_in_threadpool(_create, request, who, store, settings, idempotency_key, len(shards))
    if not created:
        response.status_code = 200
    return public_job(job)


def _create(request: JobRequest, who: Principal, store: JobStore, settings: ServiceSettings, idempotency_key: str | None,
            total: int) -> tuple[JobRow, bool]:
    """Insert the checked job (``created`` False: an idempotent repeat raced this one in)."""
    key = output_key(request.output)
    # The count and the insert under one lock: parallel submissions took 40 places of a
    # share of 3. (Per API process: replicas each hold their own, so a tenant spreading
    # submissions over N replicas can exceed it by at most N - 1.)
    _check_output_owner(request.output, key, who, store)  # filesystem work: outside the lock (the store's unique index still holds)
    with _SUBMITTING:
        _check_queue_share(who, store, settings)
        try:
            return store.create(request.model_dump(), who.name, idempotency_key, total, key)
        except OutputInUse as exc:
            raise HTTPException(409, _in_use(exc.job_id, exc.owner, who, repr(request.output))) from exc


@router.post("/jobs:validate", response_model=Validation,
             responses={429: {"model": Problem, "description": "too many validations in progress"},
                        504: {"model": Problem, "description": "the shard did not answer in time"}})
async def validate(request: JobRequest, who: Caller, settings: Settings, validations: Validations) -> Validation:
    run = validations.run(0, "too many validations in progress; retry later", validate_blocking, request, settings)
    try:
        return await asyncio.wait_for(run, timeout=settings.validate_timeout_s + 5)
    except asyncio.TimeoutError:
        raise HTTPException(504, f"the first shard did not answer within {settings.validate_timeout_s:g} s") from None


@router.get("/jobs", response_model=JobPage)
def list_jobs(who: Caller, store: Store, limit: Annotated[int, Query(ge=1, le=500)] = 50,
              offset: Annotated[int, Query(ge=0, le=10**9)] = 0, state: State | None = None) -> JobPage:
    rows, total = store.list(limit, offset, state, owner=None if who.admin else who.name)
    return JobPage(items=[public_job(r) for r in rows], total=total, limit=limit, offset=offset)


@router.get("/jobs/{job_id}", response_model=JobPublic)
def get_job(job_id: JobId, who: Caller, store: Store, request: Request) -> JobPublic:
    job, warnings = read_output_facts(request, store, job_or_404(store, job_id, who))
    return public_job(job).model_copy(update={"warnings": warnings})


def read_output_facts(request: Request, store: JobStore, job: JobRow) -> tuple[JobRow, list[str] | None]:
    """The job once its output has been looked at, and the output's warnings
    (``Browser.job_warnings``), once the job has ended; (job, None) before (``pairclean
    wait`` polls every second: a running job's folder is not listed for them) and where the
    output cannot be read right now (the job is still answered: its store row is the record).

    Where ``pairclean audit --labels`` has recalibrated the tables since the job ended, the
    job's noise-rate estimate becomes theirs (1 - mean of the audited ``p_clean``), stored, so
    lists and pages agree with every reader of the tables from then on."""
    if job.state not in TERMINAL:
        return job, None
    browser = request.app.state.browser
    try:
        warnings, audited = list(browser.job_warnings(job)), browser.audited_noise(job)
    except (OSError, ValueError, ArithmeticError, PaircleanError) as exc:  # storage, policy (UriRefused), damaged metadata
        _log.warning("job %s: the output's warnings could not be read: %s", job.id, first_line(exc))
        return job, None
    if audited is not None and (job.noise_rate is None or abs(job.noise_rate - audited) > 1e-9):
        store.update(job.id, noise_rate=audited)
        job = dataclasses.replace(job, noise_rate=audited)
    return job, warnings


@router.get("/jobs/{job_id}/shards", response_model=ShardPage)
def job_shards(job_id: JobId, who: Caller, store: Store, settings: Settings, state: schema.ShardState | None = None,
               limit: Annotated[int, Query(ge=1, le=1000)] = 100, offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> ShardPage:
    job = job_or_404(store, job_id, who)
    items = [s for s in _shard_states(job, settings) if state is None or s.state == state]
    return ShardPage(items=items[offset : offset + limit], total=len(items), limit=limit, offset=offset)


@router.get("/jobs/{job_id}/logs", response_model=JobLogs)
def job_logs(job_id: JobId, who: Caller, store: Store, runner: Runner, offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
             limit: Annotated[int, Query(ge=1, le=LOG_PAGE_BYTES)] = LOG_PAGE_BYTES) -> JobLogs:
    """The job process's output (what the runner's replica wrote), a page at a time."""
    job = job_or_404(store, job_id, who)
    return read_log(runner.logs / f"{job.id}.log", offset, limit)


@router.post("/jobs/{job_id}:cancel", response_model=JobPublic)
def cancel(job_id: JobId, who: Caller, store: Store, runner: Runner) -> JobPublic:
    job = job_or_404(store, job_id, who)
    if job.state in TERMINAL:
        raise HTTPException(409, f"job is {job.state}")
    runner.cancel(job)
    return public_job(job_or_404(store, job_id, who))


@router.post("/jobs/{job_id}:retry", response_model=JobPublic,
             responses={429: {"model": Problem, "description": "the caller has as many queued jobs as one owner may"}})
def retry(job_id: JobId, who: Caller, store: Store, settings: Settings) -> JobPublic:
    job = job_or_404(store, job_id, who)
    # The folder the submission checked: a retry must not take the job to wherever a link
    # points now (another tenant's output). Rows of releases without a key get the checks a
    # submission makes.
    key = output_key(job.request["output"])
    if job.output_key is not None and key != job.output_key:
        raise HTTPException(409, f"the output folder {job.request['output']!r} no longer resolves where it did when the job "
                                 "was submitted; submit a new job")
    if job.output_key is None:
        _check_output_owner(job.request["output"], key, who, store)
    # Rerunning the same command resumes: only the failed (uncommitted) shards are redone.
    try:
        with _SUBMITTING:
            _check_queue_share(who, store, settings)
            moved = store.transition(job_id, [PARTIAL, FAILED], state=QUEUED, error=None, finished_at=None, cancel_requested=0,
                                     output_key=key)
    except IntegrityError:
        holder = store.active_on_output(output_key(job.request["output"]))
        raise HTTPException(409, _in_use(holder.id if holder else "?", holder.owner if holder else None, who,
                                         "this job's output")) from None
    if not moved:
        raise HTTPException(409, f"only PARTIAL or FAILED jobs can be retried; this one is {job.state}")
    return public_job(job_or_404(store, job_id, who))


# -- helpers ---------------------------------------------------------------------------------

def _in_use(job_id: str, owner: str | None, who: Principal, where: str) -> str:
    """The 409 for an output another active job holds; names that job only to its owner
    (and admins): another tenant's job ids are not theirs to learn."""
    if who.admin or owner == who.name:
        return f"job {job_id} is already writing to {where}; wait for it or cancel it"
    return f"another job is already writing to {where}; choose another output folder"


def _check_queue_share(who: Principal, store: JobStore, settings: ServiceSettings) -> None:
    """429 when ``who`` already has ``max_queued_per_owner`` jobs waiting: one tenant cannot
    fill the queue (the runner also starts the jobs of owners with fewer running first)."""
    _, queued = store.list(limit=1, offset=0, state=QUEUED, owner=who.name)
    if queued >= settings.max_queued_per_owner:
        raise HTTPException(429, f"you have {queued} queued jobs, the most this service queues for one owner; "
                                 "wait for some to start or cancel some")


def _enclosing_outputs(output: str) -> list[str]:
    """The locations whose job's folders would hold ``output``: each folder above it, and
    ``X`` for ``output`` or any of those named ``X.pairclean`` (a job's side folder)."""
    import posixpath

    from pairclean.schema import SIDE_SUFFIX

    target = local_target(output)
    path = target if target is not None else output.rstrip("/")
    head = "" if target is not None else path[: path.index("://") + 3]
    parts = path[len(head):].rstrip("/").split("/")
    parents = [head + "/".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)]
    parents = [p for p in parents if p not in ("", head) and posixpath.basename(p)]
    sides = [p[: -len(SIDE_SUFFIX)] for p in [path, *parents] if p.endswith(SIDE_SUFFIX)]
    return parents + sides


def _holds(outer: str, inner: str) -> bool:
    """Whether the output at location ``outer`` (``output_location``), or its side folder, would hold
    the output ``inner`` (one resolution of ``inner``: this runs for every active job)."""
    from pairclean.schema import SIDE_SUFFIX

    try:
        place = output_location(inner)
    except (UriRefused, ValueError):  # a row of an older release whose output today's checks refuse
        return False
    side = outer + SIDE_SUFFIX
    return place.startswith(outer + "/") or place == side or place.startswith(side + "/")


def _check_output_owner(output: str, key: str, who: Principal, store: JobStore) -> None:
    """An output folder belongs to the tenant whose job first used it: a job of another
    owner may not write into it, or read it back through the job's pages (409). A local
    folder that already holds pairclean state no job of this owner ever used (written by
    the batch CLI, or by a job since deleted) is refused alike. Admins are no exception:
    a folder holds one tenant's data."""
    from pairclean.output.folder import enclosing_output, is_output
    from pairclean.schema import side_folder
    from pairclean.storage import Store as Folder

    owners = store.output_owners(key)
    if owners and owners != {who.name}:
        raise HTTPException(409, f"output {output!r} belongs to another owner's job; choose another output folder")
    # The job's state goes to its side folder (OUT.pairclean): that must not be another job's output.
    side_owners = store.output_owners(output_key(side_folder(output)))
    if side_owners and side_owners != {who.name}:
        raise HTTPException(409, f"output {output!r}: its side folder {side_folder(output)!r} is another owner's job output; "
                                 "choose another output folder")
    # Nor inside another owner's job output or side folder, though that job has written
    # nothing yet (a queued job: the disk checks below see nothing).
    for outer in _enclosing_outputs(output):
        if store.output_owners(output_key(outer)) - {who.name}:
            raise HTTPException(409, f"output {output!r} lies inside another owner's job output; choose a folder outside it")
    # ... nor hold another owner's queued or running job's folders (that job would fail when
    # this one had written: "lies inside the pairclean output ..."). Written folders of
    # finished jobs are refused by the job's own run (a folder of files it did not write).
    here = output_location(output)
    for other in store.in_states([QUEUED, RUNNING]):
        if other.owner != who.name and _holds(here, str(other.request.get("output", ""))):
            raise HTTPException(409, f"output {output!r} holds another owner's job output; choose another output folder")
    target = local_target(output)
    if target is None:
        return  # remote: the job's own run refuses a folder inside another job's output
    side = local_target(side_folder(output))
    if side is not None and is_output(os.path.exists, side):
        raise HTTPException(409, f"output {output!r}: its side folder {side_folder(output)!r} holds a pairclean job's output; "
                                 "choose another output folder")
    if not owners and is_output(os.path.exists, target):
        raise HTTPException(409, f"output {output!r} already holds a pairclean job's output that is not yours; "
                                 "choose another output folder")
    if enclosing_output(Folder(target)) is not None:
        # Not named: the outer folder may be another tenant's.
        raise HTTPException(409, f"output {output!r} lies inside another pairclean job's output; choose a folder outside it")

def expand(request: JobRequest, settings: ServiceSettings, deadline: float | None = None) -> list[str]:
    """Allow-list every location before it is touched and expand the shards; 422 otherwise,
    also once expanding runs past ``deadline`` (default: ``validate_timeout_s`` from now)."""
    from pairclean.errors import PaircleanError
    from pairclean.schema import side_folder
    from pairclean.uris import expand_shards

    def allowed_input(uri: str) -> None:
        check_uri(uri, settings.allowed_inputs, settings.allow_pipe)

    try:
        for spec in request.shards:
            if "#" in spec:  # the runner passes specs through an @list file, where '#' starts a comment
                raise UriRefused(f"{spec!r}: '#' is not accepted in shard URIs")
            allowed_input(spec[1:] if spec.startswith("@") else spec)
        check_uri(request.output, settings.allowed_outputs)
        # The job's state goes beside the output (OUT.pairclean): it must be allowed too.
        try:
            check_uri(side_folder(request.output), settings.allowed_outputs)
        except ValueError as exc:
            raise UriRefused(str(exc)) from exc
        target = local_target(request.output)
        if target is not None and os.path.exists(target) and not os.path.isdir(target):
            raise UriRefused(f"output {request.output!r} exists and is not a folder")
        # The check runs on every list file, glob and shard before it is opened or
        # listed, so nothing outside the allow-list is touched or reported on.
        limit = deadline if deadline is not None else time.monotonic() + settings.validate_timeout_s
        return expand_shards(request.shards, max_shards=settings.max_shards, check=allowed_input, deadline=limit)
    except UriRefused as exc:
        raise HTTPException(422, str(exc)) from exc
    except PaircleanError as exc:
        raise HTTPException(422, str(exc)) from exc


def validate_blocking(request: JobRequest, settings: ServiceSettings) -> Validation:
    """Expand the shards and read a bounded prefix of the first (bytes, seconds, samples)."""
    from pairclean.errors import PaircleanError
    from pairclean.read.shards import DEFAULT_MAX_MEMBER_BYTES, ReadOptions, iter_pairs_from
    from pairclean.uris import open_shard

    deadline = time.monotonic() + settings.validate_timeout_s  # the whole request's, expansion included
    shards = expand(request, settings, deadline)
    first = shards[0]
    statuses: dict[str, int] = {}
    problems: list[str] = []
    samples = 0
    options = ReadOptions(caption_field=request.options.caption_field,  # where the job will read its captions
                          max_member_bytes=min(DEFAULT_MAX_MEMBER_BYTES, settings.validate_max_bytes))
    reader: BoundedReader | None = None
    try:
        # The opener cuts the connection at the deadline: a stalled upstream frees the
        # thread and its slot then, not when the server gives up.
        with open_shard(first, http_allowed=settings.allowed_inputs, deadline=deadline) as fh:
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
    if samples == 0 and not problems:
        problems.append(f"the first shard {first!r} holds no sample (only the first shard is read: an img2dataset shard "
                        "where every download failed looks like this)")
    problems += _output_problems(request.output)
    return Validation(shards=len(shards), first_shard=first, samples=samples, statuses=statuses, problems=problems)


def _output_problems(output: str) -> list[str]:
    """What ``pairclean score`` would refuse about a local ``output`` that ``expand`` lets
    through: a folder inside another job's output (not named: it may be another tenant's)."""
    from pairclean.output.folder import enclosing_output
    from pairclean.storage import Store as Folder

    target = local_target(output)  # (an output that is a file was refused by ``expand``: a 422)
    if target is None:
        return []
    if enclosing_output(Folder(target)) is not None:
        return [f"output {output!r} lies inside another pairclean job's output"]
    return []


def _seconds_since(iso: str | None) -> float | None:
    if not iso:
        return None
    return max(0.0, (datetime.now(timezone.utc) - datetime.fromisoformat(iso)).total_seconds())


def public_job(job: JobRow) -> JobPublic:
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


def _shard_states(job: JobRow, settings: ServiceSettings) -> list[ShardPublic]:
    """Every shard of a job with its state, from the job's own output folder (``OutputMoved``,
    a 409, where that folder no longer resolves where it did at submission)."""
    from pairclean.output.folder import OutputDir
    from pairclean.uris import shard_stem

    output = checked_output(job.request["output"], job.output_key, settings.allowed_outputs)
    out = OutputDir(output, roots=job_roots(output))
    spec = out.read_spec()
    if spec is None:
        return []  # the job has not started writing yet
    committed, failed = out.committed(), out.quarantined()
    items = []
    for uri in spec.shards:
        stem = shard_stem(uri)
        if stem in committed:
            items.append(ShardPublic(shard=uri, state=schema.SHARD_COMMITTED, rows=committed[stem].rows))
        elif stem in failed:
            items.append(ShardPublic(shard=uri, state=schema.SHARD_QUARANTINED, error=failed[stem].get("error")))
        else:
            items.append(ShardPublic(shard=uri, state=schema.SHARD_PENDING))
    return items
