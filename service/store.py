"""The durable job store: SQLAlchemy Core over SQLite (default) or PostgreSQL (by URL).

The tables are ``tables.py``; every query is built from them with Core constructs and
bound parameters (no SQL text is assembled from strings). The schema is migrated at
start-up by Alembic (``migrations/``): on PostgreSQL under an advisory lock and on SQLite
under the file's write lock, so API replicas starting together apply each revision once,
and databases made by the hand-written migrations of earlier releases are adopted in
place. Every write is its own short transaction, so a crash loses at most the change in
flight.

Tenancy lives in the schema: idempotency keys are unique per owner (``owner, idem_key``),
and a partial unique index lets only one QUEUED or RUNNING job hold an output location
(``output_key``, the sha256 of the resolved output), so two jobs can never write to the
same folder at once, even when two API replicas accept them at the same moment.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import ColumnElement, Engine, Row, Select, create_engine, delete, event, func, insert, literal, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from pairclean.errors import InputError, first_line
from pairclean.job.lifecycle import ACTIVE, QUEUED, RUNNING, STATES, TERMINAL, IllegalTransition, can_move

from . import migrations
from .tables import AUDIT_LABELS, api_keys, audit_labels, audit_queues, jobs

__all__ = ["STATES", "TERMINAL", "ACTIVE", "JobRow", "JobStore", "OutputInUse", "Principal"]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class JobRow:
    """A job as stored."""

    id: str
    state: str
    request: dict[str, Any]
    idempotency_key: str | None
    owner: str | None
    error: str | None
    pid: int | None
    cancel_requested: bool
    shards_total: int
    shards_done: int
    shards_failed: int
    pairs: int
    noise_rate: float | None
    created_at: str
    started_at: str | None
    finished_at: str | None
    #: "host:state folder" of the runner that launched it (None: before migration 0005, or never launched)
    runner: str | None = None
    #: The launching runner's last heartbeat (``JobStore.beat``; None: before migration 0006,
    #: or a replica of a release without it)
    heartbeat: str | None = None
    #: sha256 of the output location resolved at submission (``security.output_key``; None:
    #: rows of releases before it): reads of the folder check it still resolves there
    output_key: str | None = None


# JobRow field -> column: the same name except the idempotency key (``idem_key`` since keys
# became per owner).
_COLUMN_OF = {field: "idem_key" if field == "idempotency_key" else field for field in JobRow.__dataclass_fields__}
# Fields update/transition may set: everything but the id and the request, plus the output key.
_SETTABLE = {field: column for field, column in _COLUMN_OF.items() if field not in {"id", "request"}} | {"output_key": "output_key"}


def _select_jobs() -> Select[Any]:
    """SELECT of every JobRow field, labelled with the field's name."""
    return select(*(jobs.c[column].label(field) for field, column in _COLUMN_OF.items()))


@dataclass(frozen=True)
class Principal:
    """Who is calling: the API key's name, whether it may see every owner's jobs, and the
    labeller its audit labels are stored as (the name and the key: an owner's team members
    each label with their own key, and their disagreements are two labellers', not one's)."""

    name: str
    admin: bool = False
    key_id: str = ""  # the first 8 hex digits of the key's sha256 (none without keys)

    @property
    def labeller(self) -> str:
        """The ``who`` of its audit labels: ``name#key_id`` (``name`` where no key identifies it)."""
        return f"{self.name[:91]}#{self.key_id}" if self.key_id else self.name  # a 100-character column

    @property
    def label_names(self) -> tuple[str, ...]:
        """The ``who`` values of labels that are its own: its labeller, and the owner's name
        (labels stored before labellers were keys: any key of the owner may undo or repeat them)."""
        return (self.labeller, self.name) if self.key_id else (self.name,)


class LabelTaken(Exception):
    """Another request stored a label of the same pair, labeller and attempt first."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: a label of this pair was stored by another request at the same time")


class OutputInUse(Exception):
    """Another QUEUED or RUNNING job holds the output location (``owner``: that job's)."""

    def __init__(self, job_id: str, owner: str | None = None) -> None:
        super().__init__(f"job {job_id} is already writing to this output")
        self.job_id, self.owner = job_id, owner


def _states(states: Sequence[str]) -> list[str]:
    return [s for s in states if s in STATES]


def _row(r: Row[Any]) -> JobRow:
    data = dict(r._mapping)
    data["request"] = json.loads(data["request"])
    data["cancel_requested"] = bool(data["cancel_requested"])
    return JobRow(**data)


def _values(fields: dict[str, Any]) -> dict[str, Any]:
    """Column values for ``fields``; names are this package's own, checked against an allow-list."""
    bad = set(fields) - set(_SETTABLE)
    if bad:
        raise ValueError(f"unknown job fields {bad}")
    if not fields:
        raise ValueError("nothing to set")
    return {_SETTABLE[name]: value for name, value in fields.items()}


def _make_sqlite_folder(url: str) -> None:
    """Make the folder of a SQLite database file (``sqlite:////data/service/jobs.db`` on a
    fresh volume): SQLite creates the file, not its folder, and the service died on
    "unable to open database file" at its first start."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:" \
            and not parsed.database.startswith("file:"):
        os.makedirs(os.path.dirname(os.path.abspath(parsed.database)), exist_ok=True)


class JobStore:
    """Jobs and API keys in a real database file (or server)."""

    def __init__(self, url: str) -> None:
        _make_sqlite_folder(url)
        self.engine: Engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        try:
            self.migrate()
        except OperationalError as exc:  # a traceback before: the file's folder missing, a server down
            where = self.engine.url.render_as_string(hide_password=True)
            raise InputError(f"the job store {where} cannot be opened: {first_line(exc.orig or exc)} "
                             "(PAIRCLEAN_DATABASE_URL)") from None
        #: A SQLite file's path and identity (device, inode) as opened: ``ping`` notices the
        #: file deleted or replaced under a running service (open connections would keep
        #: writing into the unlinked file: every job lost at the next start).
        database = self.engine.url.database if self.engine.dialect.name == "sqlite" else None
        self._file = os.path.abspath(database) if database and database != ":memory:" else None
        self._identity = _identity(self._file) if self._file else None

    def migrate(self) -> str:
        """Bring the schema to the Alembic head (see ``migrations``); returns the revision
        the database now records, read back from it."""
        return migrations.upgrade(self.engine)

    def schema_revision(self) -> str | None:
        """The Alembic revision the database records."""
        with self.engine.connect() as conn:
            return migrations.current_revision(conn)

    # -- API keys ---------------------------------------------------------------------
    def add_key(self, key_hash: str, name: str, admin: bool = False) -> None:
        """Store a key's hash under ``name``; an admin key sees every owner's jobs."""
        with self.engine.begin() as conn:
            conn.execute(insert(api_keys).values(key_hash=key_hash, name=name, admin=int(admin), created_at=_now()))

    def key_owner(self, key_hash: str) -> str | None:
        principal = self.principal(key_hash)
        return principal.name if principal else None

    def principal(self, key_hash: str) -> Principal | None:
        """The owner of a key and its role, or None for an unknown key."""
        with self.engine.connect() as conn:
            r = conn.execute(select(api_keys.c.name, api_keys.c.admin).where(api_keys.c.key_hash == key_hash)).first()
        return Principal(str(r.name), bool(r.admin), key_hash[:8]) if r else None

    # -- jobs -----------------------------------------------------------------------------
    def create(self, request: dict[str, Any], owner: str | None, idempotency_key: str | None, shards_total: int,
               output_key: str | None = None) -> tuple[JobRow, bool]:
        """Insert a QUEUED job; with an idempotency key this owner already used, return that job instead.

        Returns (job, created). Raises ``OutputInUse`` when another QUEUED or RUNNING job
        holds ``output_key``.
        """
        if idempotency_key:
            existing = self.by_idempotency_key(idempotency_key, owner)
            if existing is not None:
                return existing, False
        if output_key:
            holder = self.active_on_output(output_key)
            if holder is not None:
                raise OutputInUse(holder.id, holder.owner)
        job_id = str(uuid.uuid4())
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(jobs).values(
                    id=job_id, state=QUEUED, request=json.dumps(request), idem_key=idempotency_key, owner=owner,
                    shards_total=shards_total, output_key=output_key, created_at=_now()))
        except IntegrityError:
            # A concurrent request won the race: the same job (same key) or the output's holder.
            existing = self.by_idempotency_key(idempotency_key, owner) if idempotency_key else None
            if existing is not None:
                return existing, False
            holder = self.active_on_output(output_key) if output_key else None
            if holder is not None:
                raise OutputInUse(holder.id, holder.owner) from None
            raise
        job = self.get(job_id)
        assert job is not None
        return job, True

    def by_idempotency_key(self, key: str, owner: str | None = None) -> JobRow | None:
        """The job ``owner`` created with ``key`` (keys are per owner)."""
        same_owner = jobs.c.owner.is_(None) if owner is None else jobs.c.owner == owner
        return self._first(jobs.c.idem_key == key, same_owner)

    def active_on_output(self, output_key: str) -> JobRow | None:
        """The QUEUED or RUNNING job that holds an output location, if any."""
        return self._first(jobs.c.output_key == output_key, jobs.c.state.in_(ACTIVE))

    def output_owners(self, output_key: str) -> set[str | None]:
        """The owners of every job, in any state, that was ever given this output location:
        an output folder belongs to the tenant whose job first wrote to it."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(jobs.c.owner).where(jobs.c.output_key == output_key).distinct()).all()
        return {r[0] for r in rows}

    def get(self, job_id: str) -> JobRow | None:
        return self._first(jobs.c.id == job_id)

    def _first(self, *conditions: ColumnElement[bool]) -> JobRow | None:
        with self.engine.connect() as conn:
            r = conn.execute(_select_jobs().where(*conditions)).first()
        return _row(r) if r else None

    def list(self, limit: int, offset: int, state: str | None = None, owner: str | None = None) -> tuple[list[JobRow], int]:
        """A page of jobs, newest first, and the total count; only ``owner``'s when given."""
        conditions: list[ColumnElement[bool]] = []
        if state:
            conditions.append(jobs.c.state == state)
        if owner is not None:
            conditions.append(jobs.c.owner == owner)
        page = _select_jobs().where(*conditions).order_by(jobs.c.created_at.desc(), jobs.c.id).limit(limit).offset(offset)
        with self.engine.connect() as conn:
            total = conn.execute(select(func.count()).select_from(jobs).where(*conditions)).scalar() or 0
            rows = conn.execute(page).all()
        return [_row(r) for r in rows], int(total)

    def in_states(self, states: Sequence[str]) -> list[JobRow]:
        """Jobs in any of ``states``, oldest first."""
        query = _select_jobs().where(jobs.c.state.in_(_states(states))).order_by(jobs.c.created_at, jobs.c.id)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [_row(r) for r in rows]

    def beat(self, runner: str, value: str) -> int:
        """Set ``heartbeat`` of every RUNNING job launched by ``runner``; returns how many."""
        statement = update(jobs).where(jobs.c.runner == runner, jobs.c.state == RUNNING).values(heartbeat=value)
        with self.engine.begin() as conn:
            return int(conn.execute(statement).rowcount)

    def update(self, job_id: str, **fields: Any) -> None:
        """Set fields of one job (names are this package's own, never user input).

        The state is not one of them: it changes only through ``transition``.
        """
        if "state" in fields:
            raise IllegalTransition("job states change through JobStore.transition")
        statement = update(jobs).where(jobs.c.id == job_id).values(_values(fields))
        with self.engine.begin() as conn:
            conn.execute(statement)

    def transition(self, job_id: str, from_states: Sequence[str], *, expect: dict[str, Any] | None = None, **fields: Any) -> bool:
        """Update only if the job is in one of ``from_states`` (and its fields equal ``expect``,
        e.g. the launch a caller saw: ``{"runner": ..., "started_at": ...}``); returns whether it was.

        Raises ``IllegalTransition`` when ``state`` is not a move the lifecycle
        (``pairclean.job.lifecycle``) allows from every one of ``from_states``.
        """
        target = fields.get("state")
        if target is not None:
            illegal = [s for s in from_states if not can_move(s, target)]
            if illegal or target not in STATES:
                raise IllegalTransition(f"a job cannot go from {illegal or list(from_states)} to {target!r}")
        same = [jobs.c[column].is_(None) if value is None else jobs.c[column] == value
                for column, value in (_values(expect).items() if expect else ())]
        statement = (update(jobs).where(jobs.c.id == job_id, jobs.c.state.in_(_states(from_states)), *same)
                     .values(_values(fields)))
        with self.engine.begin() as conn:
            result = conn.execute(statement)
        return bool(result.rowcount)

    def counts_by_state(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state)).all()
        return {state: 0 for state in STATES} | {r[0]: int(r[1]) for r in rows}

    # -- audit (issue 22) ---------------------------------------------------------------------
    def audit_queue(self, job_id: str) -> dict[str, Any] | None:
        """The job's frozen audit queue (``seed``, ``sample``, ``design`` as stored), or None."""
        with self.engine.connect() as conn:
            r = conn.execute(select(audit_queues.c.seed, audit_queues.c.sample, audit_queues.c.design)
                             .where(audit_queues.c.job_id == job_id)).first()
        return {"seed": int(r.seed), "sample": int(r.sample), "design": json.loads(r.design)} if r else None

    def put_audit_queue(self, job_id: str, tenant: str | None, seed: int, sample: int, design: dict[str, Any]) -> dict[str, Any]:
        """Freeze the job's queue; when another request froze one first, that one is kept and returned."""
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(audit_queues).values(job_id=job_id, tenant=tenant, seed=seed, sample=sample,
                                                         design=json.dumps(design), created_at=_now()))
        except IntegrityError:
            pass
        got = self.audit_queue(job_id)
        assert got is not None
        return got

    def add_labels(self, job_id: str, tenant: str | None, who: str, items: Sequence[tuple[int, str, str, int]]) -> int:
        """Store labels ``(queue position, key, label, attempt)`` given by ``who`` on a
        tenant's job, all or none; ``attempt``: how many labels of that pair ``who`` held when
        the label was checked (one more than the highest it held). Raises ``LabelTaken`` where
        another request stored that attempt first (another replica checked the same labels at
        the same time)."""
        if any(label not in AUDIT_LABELS for _, _, label, _ in items):
            raise ValueError("label must be one of " + ", ".join(AUDIT_LABELS))
        # to the microsecond (32 characters): a blind repeat stored within the second of the
        # first label was exported as the same row, and the CLI counted it once
        now = datetime.now(timezone.utc).isoformat(timespec="microseconds")
        # In one order (pair, attempt): two replicas inserting overlapping labels in opposite
        # orders deadlocked on PostgreSQL's unique index (a 500) instead of one losing cleanly.
        rows = [{"job_id": job_id, "tenant": tenant, "position": pos, "key": key, "label": label, "who": who, "labelled_at": now,
                 "attempt": attempt} for pos, key, label, attempt in sorted(items, key=lambda item: (item[0], item[3]))]
        if rows:
            try:
                with self.engine.begin() as conn:
                    conn.execute(insert(audit_labels), rows)
            except IntegrityError as exc:  # the unique (job, who, pair, attempt) index: a concurrent store won
                raise LabelTaken(job_id) from exc
        return len(rows)

    def audit_labels(self, job_id: str, tenant: str | None) -> list[dict[str, Any]]:
        """Every label of the job (of its tenant), oldest first."""
        same = audit_labels.c.tenant.is_(None) if tenant is None else audit_labels.c.tenant == tenant
        query = (select(audit_labels.c.id, audit_labels.c.position, audit_labels.c.key, audit_labels.c.label, audit_labels.c.who,
                        audit_labels.c.labelled_at, audit_labels.c.attempt)
                 .where(audit_labels.c.job_id == job_id, same).order_by(audit_labels.c.id))
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]

    def count_labels(self, job_id: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(audit_labels).where(audit_labels.c.job_id == job_id)).scalar() or 0)

    def undo_label(self, job_id: str, who: str | Sequence[str]) -> dict[str, Any] | None:
        """Remove the latest label on the job stored as any of ``who``; returns it (None when there is none).

        The label returned is the one this call deleted: another undo (of another replica)
        that deleted it first sends this one on to the next latest."""
        while True:
            with self.engine.begin() as conn:
                r = conn.execute(select(audit_labels.c.id, audit_labels.c.position, audit_labels.c.key, audit_labels.c.label)
                                 .where(audit_labels.c.job_id == job_id, audit_labels.c.who.in_([who] if isinstance(who, str) else list(who)))
                                 .order_by(audit_labels.c.id.desc()).limit(1)).first()
                if r is None:
                    return None
                if conn.execute(delete(audit_labels).where(audit_labels.c.id == r.id)).rowcount == 1:
                    return dict(r._mapping)

    def ping(self) -> bool:
        """Whether the store answers and, for a SQLite file, is still the file it opened and
        writable (``/readyz`` reports what a job submission would meet)."""
        if self._file is not None and (_identity(self._file) != self._identity or not os.access(self._file, os.W_OK)):
            return False
        try:
            with self.engine.connect() as conn:
                return conn.execute(select(literal(1))).scalar() == 1
        except Exception:  # noqa: BLE001 - any failure to answer is "not ready", never a 500
            return False


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path``, or None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets status readers proceed while the runner writes; a busy timeout instead of
    # "database is locked" errors under concurrent pollers.
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()
    migrations.use_wal(dbapi_conn, 5.0)


Clock = Callable[[], str]
now_iso: Clock = _now
