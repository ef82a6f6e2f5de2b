"""The job store's schema as SQLAlchemy Core tables: what the Alembic head creates.

``tests/service/test_migrations.py`` compares this metadata with a database migrated to
the head (``alembic.autogenerate.compare_metadata``), so a change here without a migration
in ``migrations/versions/`` (or the other way round) fails the suite.

Types stay those of the first releases (ISO-8601 text timestamps, 0/1 integers for flags)
so databases created before Alembic adopt this schema without a table rewrite.
"""

from __future__ import annotations

from sqlalchemy import CheckConstraint, Column, Double, ForeignKey, Index, Integer, MetaData, String, Table, Text, text

from pairclean.job.lifecycle import ACTIVE

__all__ = ["metadata", "jobs", "api_keys", "audit_queues", "audit_labels", "AUDIT_LABELS"]

metadata = MetaData()

_ZERO = text("0")  # a constant server default, not built from input

jobs = Table(
    "jobs",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("request", Text, nullable=False),  # the validated request, as JSON
    Column("owner", String(100)),
    # Idempotency keys are per owner (unique index below). The first release had a global
    # UNIQUE ``idempotency_key`` column; migration 0003 drops it.
    Column("idem_key", String(200)),
    Column("error", Text),
    Column("pid", Integer),
    Column("cancel_requested", Integer, nullable=False, server_default=_ZERO),
    Column("shards_total", Integer, nullable=False, server_default=_ZERO),
    Column("shards_done", Integer, nullable=False, server_default=_ZERO),
    Column("shards_failed", Integer, nullable=False, server_default=_ZERO),
    Column("pairs", Integer, nullable=False, server_default=_ZERO),
    Column("noise_rate", Double),
    Column("created_at", String(32), nullable=False),
    Column("started_at", String(32)),
    Column("finished_at", String(32)),
    # sha256 of the resolved output location (pairclean_service.security.output_key)
    Column("output_key", String(64)),
    # the runner that launched a RUNNING job: "host:state folder" (migration 0005)
    Column("runner", String(300)),
    # the launching runner's heartbeat while the job runs (migration 0006): compared between
    # looks by other replicas, never against their clocks
    Column("heartbeat", String(32)),
)

Index("jobs_state", jobs.c.state)
Index("jobs_owner_idem", jobs.c.owner, jobs.c.idem_key, unique=True)
# Only one QUEUED or RUNNING job may hold an output location: a partial unique index, so
# two replicas accepting jobs for one folder at the same moment cannot both insert.
Index("jobs_active_output", jobs.c.output_key, unique=True,
      sqlite_where=jobs.c.state.in_(ACTIVE), postgresql_where=jobs.c.state.in_(ACTIVE))

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_hash", String(64), primary_key=True),  # sha256 hex of the key; keys are never stored
    Column("name", String(100), nullable=False),
    Column("created_at", String(32), nullable=False),
    Column("admin", Integer, nullable=False, server_default=_ZERO),
)

#: The label values (an enum by CHECK constraint, the same on SQLite and PostgreSQL).
AUDIT_LABELS = ("clean", "noisy", "unsure")

# A job's audit queue (issue 22), frozen when first asked for: the design (strata sizes,
# draws, seed) and the queued pairs as JSON. One row per job; bounded by the queue size.
audit_queues = Table(
    "audit_queues",
    metadata,
    Column("job_id", String(36), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("tenant", String(100)),  # the job's owner
    Column("seed", Integer, nullable=False),
    Column("sample", Integer, nullable=False),
    Column("design", Text, nullable=False),
    Column("created_at", String(32), nullable=False),
)

# Human labels of queued pairs: who said what, when, for which tenant's job. ``position``
# is the pair's place in the job's queue (the pair itself is in the queue's JSON).
audit_labels = Table(
    "audit_labels",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(36), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("tenant", String(100)),
    Column("position", Integer, nullable=False),
    Column("key", Text, nullable=False),
    Column("label", String(8), CheckConstraint("label IN ('clean', 'noisy', 'unsure')", name="audit_label_value"), nullable=False),
    Column("who", String(100), nullable=False),
    Column("labelled_at", String(32), nullable=False),
    # which of ``who``'s labels of this pair it is (0 the first, 1 the asked-for blind repeat):
    # unique below, so one label checked and stored by two replicas at once is stored once
    Column("attempt", Integer, nullable=False, server_default="0"),
)

Index("audit_labels_job", audit_labels.c.job_id, audit_labels.c.position)
Index("audit_labels_attempt", audit_labels.c.job_id, audit_labels.c.who, audit_labels.c.position, audit_labels.c.attempt, unique=True)
Index("audit_labels_who", audit_labels.c.job_id, audit_labels.c.who, audit_labels.c.id)
