"""The job store's Alembic migrations on real SQLite files (PostgreSQL: test_store_postgres.py).

The head matches the Core tables, databases made by the pre-Alembic releases are adopted
with their rows, and replicas starting together on one fresh file end at one head.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Engine, MetaData, String, create_engine, inspect
from store_fixtures import build_legacy, recorded_revisions, start_replicas

from pairclean_service import migrations
from pairclean_service.store import JobStore, OutputInUse
from pairclean_service.tables import metadata


def _diffs(engine: Engine, target: MetaData = metadata) -> list[object]:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), target)


def test_head_matches_the_core_tables(tmp_path: Path) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 'j.db'}")
    assert recorded_revisions(store.engine) == [migrations.head()] == [store.migrate()]
    assert _diffs(store.engine) == []
    # The comparison sees the schema: a column the migrations never made is a difference.
    extra = MetaData()
    for t in metadata.tables.values():
        t.to_metadata(extra)
    extra.tables["jobs"].append_column(Column("priority", String(8)))
    assert [d[0] for d in _diffs(store.engine, extra)] == ["add_column"]  # type: ignore[index]


@pytest.mark.parametrize("version", [3, 9])
def test_pre_alembic_databases_are_adopted_and_keep_their_rows(tmp_path: Path, version: int) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    legacy = create_engine(url)
    build_legacy(legacy, version)
    store = JobStore(url)
    # Stamped, then upgraded: one head recorded, the legacy bookkeeping gone, and the
    # schema now the same as a fresh database's (with the rows the release wrote).
    assert recorded_revisions(legacy) == [migrations.head()]
    assert "schema_version" not in inspect(legacy).get_table_names()
    assert _diffs(legacy) == []
    found = store.by_idempotency_key("k", "alice")
    assert found is not None and found.id == "j1" and found.request == {"output": "/o"}
    assert store.by_idempotency_key("k", "bob") is None  # keys are per owner
    principal = store.principal("h")
    assert principal is not None and principal.name == "alice" and not principal.admin
    if version == 9:  # the partial unique index still guards the queued job's output
        with pytest.raises(OutputInUse) as info:
            store.create({}, "bob", None, 1, output_key="out-1")
        assert info.value.job_id == "j2"
    assert store.transition("j2", ["QUEUED"], state="CANCELLED")
    JobStore(url)  # a restart applies nothing and keeps the rows
    assert recorded_revisions(legacy) == [migrations.head()] and store.list(10, 0)[1] == 2


def test_a_legacy_version_no_release_left_is_refused_untouched(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'odd.db'}"
    legacy = create_engine(url)
    build_legacy(legacy, 5, rows=False)  # a hand-made state between releases
    with pytest.raises(migrations.MigrationError, match="schema_version 5"):
        JobStore(url)
    assert "alembic_version" not in inspect(legacy).get_table_names()


def test_downgrade_to_nothing_and_back(tmp_path: Path) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 'j.db'}")
    store.create({}, "alice", "k", 1, output_key="o")
    with store.engine.begin() as conn:
        command.downgrade(migrations.config(conn), "base")
    assert set(inspect(store.engine).get_table_names()) <= {"alembic_version"}
    assert store.migrate() == migrations.head() and _diffs(store.engine) == []


def test_threads_starting_together_on_one_fresh_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    barrier, revisions, errors = threading.Barrier(6), [], []

    def start() -> None:
        barrier.wait()
        try:
            revisions.append(JobStore(url).schema_revision())
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and revisions == [migrations.head()] * 6
    assert recorded_revisions(create_engine(url)) == [migrations.head()]


@pytest.mark.slow
def test_processes_starting_together_on_one_fresh_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    results = start_replicas(url, 6, tmp_path)
    assert results == [{"revision": migrations.head()}] * 6
    assert recorded_revisions(create_engine(url)) == [migrations.head()]
    assert _diffs(create_engine(url)) == []


@pytest.mark.slow
def test_processes_adopting_one_legacy_file_together(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    build_legacy(create_engine(url), 9)
    assert start_replicas(url, 4, tmp_path) == [{"revision": migrations.head()}] * 4
    assert recorded_revisions(create_engine(url)) == [migrations.head()]
    assert JobStore(url).get("j1") is not None


def test_no_sql_in_the_service_is_built_from_strings() -> None:
    """SQL text appears only as constants: every query of the store is a Core construct."""
    import ast

    service = Path(__file__).resolve().parents[2] / "service"
    raw_sql_calls = {"text", "literal_column", "exec_driver_sql", "execute", "executescript"}
    offenders = []
    for path in sorted(service.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            # A constant is fine; so is a Core construct (a call, a name); what is not is SQL
            # assembled here: f-strings, concatenation, %-formatting, .format/.join.
            built = isinstance(first, (ast.JoinedStr, ast.BinOp)) or (
                isinstance(first, ast.Call) and isinstance(first.func, ast.Attribute) and first.func.attr in {"format", "join"})
            if name in raw_sql_calls and (built or (name != "execute" and not isinstance(first, ast.Constant))):
                offenders.append(f"{path.relative_to(service.parent)}:{node.lineno}")
    assert offenders == []


def test_labels_stored_before_0007_are_numbered_by_attempt(tmp_path: Path) -> None:
    """A database at 0006 whose labeller labelled one pair twice (a blind repeat, or a race
    of two replicas) upgrades: the labels are kept, numbered 0 and 1 in the order stored."""
    from sqlalchemy import select, text

    from pairclean_service.tables import audit_labels

    store = JobStore(f"sqlite:///{tmp_path / 'j.db'}")
    job, _ = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team-a", None, 1)
    with store.engine.begin() as conn:
        command.downgrade(migrations.config(conn), "0006")
    with store.engine.begin() as conn:
        for who, pos in (("alice", 0), ("alice", 0), ("bob", 0), ("alice", 1), ("alice", 0)):
            conn.execute(text("INSERT INTO audit_labels (job_id, tenant, position, key, label, who, labelled_at) "
                              "VALUES (:j, 'team-a', :p, 'k', 'clean', :w, '2026-01-01T00:00:00+00:00')"),
                         {"j": job.id, "p": pos, "w": who})
    assert store.migrate() == migrations.head() and _diffs(store.engine) == []
    with store.engine.connect() as conn:
        rows = conn.execute(select(audit_labels.c.who, audit_labels.c.position, audit_labels.c.attempt).order_by(audit_labels.c.id)).all()
    assert [tuple(r) for r in rows] == [("alice", 0, 0), ("alice", 0, 1), ("bob", 0, 0), ("alice", 1, 0), ("alice", 0, 2)]
