"""The job store on a real PostgreSQL server (``.ci/run`` installs and starts one).

Set ``PAIRCLEAN_TEST_POSTGRES_URL`` (e.g. ``postgresql+psycopg://user:pw@127.0.0.1/db``)
to run these; without it they skip, and the SQLite tests still cover the store.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_fixtures import build_legacy, recorded_revisions, start_replicas

URL = os.environ.get("PAIRCLEAN_TEST_POSTGRES_URL")
pytestmark = pytest.mark.skipif(not URL, reason="no PostgreSQL server: set PAIRCLEAN_TEST_POSTGRES_URL (.ci/run starts one)")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh schema per test: the store's migrations start from nothing."""
    from sqlalchemy import create_engine
    from sqlalchemy.schema import CreateSchema, DropSchema

    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(URL)
    with engine.begin() as conn:
        conn.execute(CreateSchema(schema))
    yield f"{URL}{'&' if '?' in URL else '?'}options=-csearch_path%3D{schema}"
    with engine.begin() as conn:
        conn.execute(DropSchema(schema, cascade=True))
    engine.dispose()


def _diffs(url: str) -> list[object]:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    from pairclean_service.tables import metadata

    engine = create_engine(url)
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), metadata)
    engine.dispose()
    return diffs


def test_store_on_postgres(pg_url: str) -> None:
    from pairclean_service import migrations
    from pairclean_service.store import JobStore, OutputInUse

    store = JobStore(pg_url)
    # Read from the database itself: one row in Alembic's table, the head of this release.
    assert recorded_revisions(store.engine) == [migrations.head()] == [store.schema_revision()] and store.ping()
    assert _diffs(pg_url) == []  # the head is the Core tables
    job, created = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team", "key-1", 1, output_key="o1")
    again, created_again = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team", "key-1", 1, output_key="o1")
    assert created and not created_again and again.id == job.id
    with pytest.raises(OutputInUse):
        store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team", None, 1, output_key="o1")
    assert store.transition(job.id, ["QUEUED"], state="RUNNING", pid=123)
    assert not store.transition(job.id, ["QUEUED"], state="RUNNING")
    store.update(job.id, shards_done=1, pairs=10, noise_rate=0.2)
    row = store.get(job.id)
    assert row is not None and (row.state, row.pairs, row.noise_rate) == ("RUNNING", 10, 0.2)
    rows, total = store.list(10, 0, "RUNNING")
    assert total == 1 and rows[0].id == job.id
    assert store.counts_by_state()["RUNNING"] == 1
    assert JobStore(pg_url).migrate() == migrations.head()  # a restart applies nothing
    assert recorded_revisions(store.engine) == [migrations.head()]
    other, _ = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "other-team", "key-1", 1)
    assert other.id != job.id  # idempotency keys are per owner


@pytest.mark.parametrize("version", [3, 9])
def test_pre_alembic_database_on_postgres_is_adopted(pg_url: str, version: int) -> None:
    from sqlalchemy import create_engine, inspect

    from pairclean_service import migrations
    from pairclean_service.store import JobStore

    legacy = create_engine(pg_url)
    build_legacy(legacy, version)
    store = JobStore(pg_url)
    assert recorded_revisions(legacy) == [migrations.head()]
    assert "schema_version" not in inspect(legacy).get_table_names()
    assert _diffs(pg_url) == []
    found = store.by_idempotency_key("k", "alice")
    assert found is not None and found.id == "j1" and store.by_idempotency_key("k", "bob") is None
    legacy.dispose()


@pytest.mark.slow
def test_job_lifecycle_on_postgres(pg_url: str, make_shards, tmp_path: Path, live_server_cls) -> None:
    import httpx

    from pairclean_service.client import PaircleanClient

    shards = make_shards(n_shards=2, per_shard=4, folder=tmp_path / "shards")
    with live_server_cls(tmp_path, database_url=pg_url) as live:
        client = PaircleanClient(live.url, live.key)
        job_id = client.submit([str(s) for s in shards], str(tmp_path / "out"), estimator="pairclean-tiny-test")
        assert client.wait(job_id, timeout=300, poll=0.2)["progress"]["shards_done"] == 2
        assert httpx.get(f"{live.url}/readyz").status_code == 200


def test_replicas_starting_together_migrate_once(pg_url: str, tmp_path: Path) -> None:
    from sqlalchemy import create_engine

    from pairclean_service import migrations

    # Separate processes, released at the same moment after their imports: one migrates
    # under the advisory lock, the others wait and find the head.
    assert start_replicas(pg_url, 4, tmp_path) == [{"revision": migrations.head()}] * 4
    engine = create_engine(pg_url)
    assert recorded_revisions(engine) == [migrations.head()]
    engine.dispose()
    assert _diffs(pg_url) == []


def test_replicas_adopting_one_legacy_database_together(pg_url: str, tmp_path: Path) -> None:
    from sqlalchemy import create_engine

    from pairclean_service import migrations

    engine = create_engine(pg_url)
    build_legacy(engine, 9)
    assert start_replicas(pg_url, 4, tmp_path) == [{"revision": migrations.head()}] * 4
    assert recorded_revisions(engine) == [migrations.head()]
    engine.dispose()
