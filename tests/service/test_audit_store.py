"""The audit's tables (migration 0004) on a real SQLite file and, when one is given, a real
PostgreSQL server (``PAIRCLEAN_TEST_POSTGRES_URL``, as test_store_postgres.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pairclean_service.store import JobStore, LabelTaken
from pairclean_service.tables import audit_labels
from sqlalchemy import create_engine, insert
from sqlalchemy.exc import IntegrityError

PG = os.environ.get("PAIRCLEAN_TEST_POSTGRES_URL")


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'jobs.db'}"
        return
    if not PG:
        pytest.skip("no PostgreSQL server: set PAIRCLEAN_TEST_POSTGRES_URL (.ci/run starts one)")
    from sqlalchemy.schema import CreateSchema, DropSchema

    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(PG)
    with engine.begin() as conn:
        conn.execute(CreateSchema(schema))
    yield f"{PG}{'&' if '?' in PG else '?'}options=-csearch_path%3D{schema}"
    with engine.begin() as conn:
        conn.execute(DropSchema(schema, cascade=True))
    engine.dispose()


def test_queue_labels_undo_and_tenancy(url: str) -> None:
    store = JobStore(url)
    job, _ = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team-a", None, 1)
    assert store.audit_queue(job.id) is None
    design = {"design": {"sizes": [3]}, "queue": [{"key": "k0"}, {"key": "k1"}]}
    got = store.put_audit_queue(job.id, "team-a", 0, 2, design)
    assert got == {"seed": 0, "sample": 2, "design": design}
    # a second freeze (another replica, a race) keeps the first queue
    assert store.put_audit_queue(job.id, "team-a", 5, 9, {"design": {}, "queue": []})["design"] == design

    assert store.add_labels(job.id, "team-a", "alice", [(0, "k0", "clean", 0), (1, "k1", "unsure", 0)]) == 2
    store.add_labels(job.id, "team-a", "bob", [(0, "k0", "noisy", 0)])
    rows = store.audit_labels(job.id, "team-a")
    assert [(r["position"], r["label"], r["who"]) for r in rows] == [(0, "clean", "alice"), (1, "unsure", "alice"), (0, "noisy", "bob")]
    assert store.audit_labels(job.id, "team-b") == []  # labels are per tenant
    assert store.count_labels(job.id) == 3
    undone = store.undo_label(job.id, "alice")
    assert undone is not None and undone["key"] == "k1" and undone["label"] == "unsure"
    assert [r["who"] for r in store.audit_labels(job.id, "team-a")] == ["alice", "bob"]
    assert store.undo_label(job.id, "carol") is None
    with pytest.raises(ValueError):
        store.add_labels(job.id, "team-a", "alice", [(0, "k0", "maybe", 0)])


def test_the_label_is_an_enum_in_the_database_itself(url: str) -> None:
    store = JobStore(url)
    job, _ = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team-a", None, 1)
    with pytest.raises(IntegrityError), store.engine.begin() as conn:
        conn.execute(insert(audit_labels).values(job_id=job.id, tenant="team-a", position=0, key="k", label="maybe",
                                                 who="alice", labelled_at="2026-01-01T00:00:00+00:00"))


def test_one_attempt_of_a_pair_by_one_labeller_is_stored_once(url: str) -> None:
    """Two replicas that both checked a double-clicked label each store it as attempt 0: the
    database keeps the first and refuses the whole second request."""
    store = JobStore(url)
    job, _ = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team-a", None, 1)
    store.put_audit_queue(job.id, "team-a", 0, 2, {"design": {}, "queue": [{"key": "k0"}, {"key": "k1"}]})
    assert store.add_labels(job.id, "team-a", "alice", [(0, "k0", "clean", 0)]) == 1
    with pytest.raises(LabelTaken):
        store.add_labels(job.id, "team-a", "alice", [(1, "k1", "noisy", 0), (0, "k0", "clean", 0)])
    assert [(r["position"], r["label"]) for r in store.audit_labels(job.id, "team-a")] == [(0, "clean")]  # all or none
    store.add_labels(job.id, "team-a", "alice", [(0, "k0", "clean", 1)])  # the blind repeat is its own attempt
    store.add_labels(job.id, "team-a", "bob", [(0, "k0", "noisy", 0)])  # another labeller's first
    assert store.count_labels(job.id) == 3
    store.undo_label(job.id, "alice")
    store.add_labels(job.id, "team-a", "alice", [(0, "k0", "noisy", 1)])  # an undone attempt can be made again
    assert store.count_labels(job.id) == 3


def test_two_replicas_checking_one_label_at_once_store_it_once(tmp_path: Path) -> None:
    """Two API processes (two Auditors, each with its own lock) on one store: both read the
    labels before either stores (a barrier in the store's read), as on two replicas."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pairclean_service.audit import Auditor
    from pairclean_service.metrics import Metrics
    from pairclean_service.settings import ServiceSettings
    from pairclean_service.store import Principal

    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    job, _ = store.create({"shards": ["/d/a.tar"], "output": "/d/o"}, "team-a", None, 1)
    assert store.transition(job.id, ["QUEUED"], state="RUNNING") and store.transition(job.id, ["RUNNING"], state="SUCCEEDED")
    store.put_audit_queue(job.id, "team-a", 0, 2, {"design": {"sizes": [2]}, "queue": [{"key": "k0"}, {"key": "k1"}]})
    barrier, read = threading.Barrier(2, timeout=10), store.audit_labels
    first_reads = iter([True, True])

    def read_together(job_id: str, tenant: str | None) -> list:
        got = read(job_id, tenant)
        if next(first_reads, False):  # each replica's first check waits for the other's
            barrier.wait()
        return got

    store.audit_labels = read_together  # type: ignore[method-assign]
    settings = ServiceSettings(database_url=f"sqlite:///{tmp_path / 'jobs.db'}")
    replicas = [Auditor(settings, store, None, Metrics()) for _ in range(2)]  # type: ignore[arg-type]
    alice = Principal("team-a", admin=False)
    body = [{"position": 0, "key": "k0", "label": "clean"}]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda a: a.add(store.get(job.id), alice, body), replicas))
    assert sorted((r["stored"], r["already_stored"]) for r in replies) == [(0, 1), (1, 0)]
    assert [(r["position"], r["label"]) for r in read(job.id, "team-a")] == [(0, "clean")]


def test_the_next_attempt_is_one_more_than_the_highest_held_not_the_count() -> None:
    from pairclean_service.audit import next_attempt

    assert next_attempt([]) == 0
    assert next_attempt([{"attempt": 0}, {"attempt": 1}]) == 2
    assert next_attempt([{"attempt": 1}]) == 2  # a gap left by undos that raced a repeat: 1 is taken


def test_replicas_storing_one_batch_in_opposite_orders_store_it_once(url: str) -> None:
    """Two replicas (two Auditors, two engines) check one labeller's 200 first labels at once,
    sent to each in the opposite order: on PostgreSQL the inserts deadlocked on the unique
    index (a 500 in about one round in three) before add_labels stored rows in one order."""
    import threading

    from pairclean_service.audit import Auditor
    from pairclean_service.metrics import Metrics
    from pairclean_service.settings import ServiceSettings
    from pairclean_service.store import Principal

    n = 200
    for trial in range(3):
        first = JobStore(url)
        job, _ = first.create({"shards": ["/d/a.tar"], "output": f"/d/o{trial}"}, "team-a", None, 1)
        assert first.transition(job.id, ["QUEUED"], state="RUNNING") and first.transition(job.id, ["RUNNING"], state="SUCCEEDED")
        first.put_audit_queue(job.id, "team-a", 0, n, {"design": {"sizes": [n]}, "queue": [{"key": f"k{i}"} for i in range(n)]})
        stores, barrier = [JobStore(url), JobStore(url)], threading.Barrier(2, timeout=20)
        for store in stores:
            read, once = store.audit_labels, iter([True])

            def read_together(job_id: str, tenant: str | None, read=read, once=once) -> list:  # type: ignore[no-untyped-def]
                got = read(job_id, tenant)
                if next(once, False):  # each replica's first check waits for the other's
                    barrier.wait()
                return got

            store.audit_labels = read_together  # type: ignore[method-assign]
        replicas = [Auditor(ServiceSettings(database_url=url), s, None, Metrics()) for s in stores]  # type: ignore[arg-type]
        body = [{"position": i, "key": f"k{i}", "label": "clean"} for i in range(n)]
        replies: list[object] = []

        def send(i: int) -> None:
            try:
                replies.append(replicas[i].add(stores[i].get(job.id), Principal("team-a"), body if i == 0 else body[::-1]))
            except Exception as exc:  # noqa: BLE001 - what the test reports: a 500's cause
                replies.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(replies, key=str) == [{"stored": 0, "already_stored": n}, {"stored": n, "already_stored": 0}], (trial, replies)
        assert first.count_labels(job.id) == n
        for s in (first, *stores):
            s.engine.dispose()
