"""The job store on a real PostgreSQL server (``.ci/run`` installs and starts one).

Set ``PAIRCLEAN_TEST_POSTGRES_URL`` (e.g. ``postgresql+psycopg://user:pw@127.0.0.1/db``)
to run these; without it they skip, and the SQLite tests still cover the store.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

URL = os.environ.get("PAIRCLEAN_TEST_POSTGRES_URL")
pytestmark = pytest.mark.skipif(not URL, reason="no PostgreSQL server: set PAIRCLEAN_TEST_POSTGRES_URL (.ci/run starts one)")


@pytest.fixture
def pg_url() -> str:
    """A fresh schema per test: the store's migrations start from nothing."""
    from sqlalchemy import create_engine, text

    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(URL)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    yield f"{URL}{'&' if '?' in URL else '?'}options=-csearch_path%3D{schema}"
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))


def test_store_on_postgres(pg_url: str) -> None:
    from sqlalchemy import text

    from pairclean_service.store import _MIGRATIONS, JobStore

    store = JobStore(pg_url)
    # schema_version() reads the database, so this fails if a migration was not recorded.
    assert store.migrate() == store.schema_version() == len(_MIGRATIONS) and store.ping()
    job, created = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team", "key-1", 1)
    again, created_again = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team", "key-1", 1)
    assert created and not created_again and again.id == job.id
    assert store.transition(job.id, ["QUEUED"], state="RUNNING", pid=123)
    assert not store.transition(job.id, ["QUEUED"], state="RUNNING")
    store.update(job.id, shards_done=1, pairs=10, noise_rate=0.2)
    row = store.get(job.id)
    assert row is not None and (row.state, row.pairs, row.noise_rate) == ("RUNNING", 10, 0.2)
    rows, total = store.list(10, 0, "RUNNING")
    assert total == 1 and rows[0].id == job.id
    assert store.counts_by_state()["RUNNING"] == 1
    JobStore(pg_url).migrate()  # idempotent on restart: every migration recorded once, none again
    with store.engine.connect() as conn:
        versions = [row[0] for row in conn.execute(text("SELECT version FROM schema_version ORDER BY version"))]
    assert versions == list(range(1, len(_MIGRATIONS) + 1))
    other, _ = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "other-team", "key-1", 1)
    assert other.id != job.id  # idempotency keys are per owner


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


def test_replicas_starting_together_migrate_once(pg_url: str) -> None:
    import threading

    from sqlalchemy import create_engine, text

    from pairclean_service.store import _MIGRATIONS, JobStore

    errors: list[BaseException] = []

    def start() -> None:
        try:
            JobStore(pg_url)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with create_engine(pg_url).connect() as conn:
        versions = [r[0] for r in conn.execute(text("SELECT version FROM schema_version ORDER BY version"))]
    assert versions == list(range(1, len(_MIGRATIONS) + 1))  # each migration applied exactly once
