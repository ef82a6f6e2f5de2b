"""The REST job carries what `pairclean inspect` warns of (``warnings``), read from the
job's own output over real HTTP against the live demo service."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow


def _get(service, path: str) -> httpx.Response:
    return httpx.get(f"{service.url}{path}", headers={"Authorization": f"Bearer {service.keys['team-a']}"})


def _plant_junk_fit(out_dir, share: float) -> None:
    """Rewrite the job's table with a p_clean fit whose random-level share its random part
    does not explain (what calibrate records on a junk-heavy corpus); the rest as written."""
    import pyarrow.parquet as pq

    from pairclean import schema

    (path,) = sorted(out_dir.glob("*.parquet"))
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[schema.META_KEY])
    p_clean = meta.setdefault("p_clean", {})
    p_clean["fit"] = {**(p_clean.get("fit") or {}), "pi_random": 0.0,
                      "random_level": {"threshold": 0.1, "quantile": 0.75, "share": share}}
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, schema.META_KEY: json.dumps(meta).encode()}), path)


def _finished_unread(service, name: str) -> str:
    """A scored copy of the demo shard, waited for through the job list only: the warnings are
    cached per committed table, so no ``GET /v1/jobs/{id}`` may read them before the plant."""
    import shutil
    import time

    folder = service.root / name
    folder.mkdir()
    job = service.submit([str(shutil.copy(service.shard, folder / "copy-000000.tar"))], str(folder / "out"))
    deadline = time.time() + 600
    while time.time() < deadline:
        state = {j["id"]: j["state"] for j in _get(service, "/v1/jobs?limit=500").json()["items"]}[job]
        if state not in ("QUEUED", "RUNNING"):
            assert state == "SUCCEEDED"
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job} did not end")


def test_a_job_carries_the_junk_warning_of_its_output_and_lists_leave_it_out(demo_service) -> None:
    from pairclean.output.report import junk_warning

    clean = _get(demo_service, f"/v1/jobs/{demo_service.job_id}").json()
    assert clean["warnings"] == []  # the demo sample shows no junk
    job = _finished_unread(demo_service, "warned")
    _plant_junk_fit(demo_service.root / "warned" / "out", share=0.4)
    body = _get(demo_service, f"/v1/jobs/{job}").json()
    assert body["warnings"] == [junk_warning(0.4)] and body["warnings"][0].startswith("WARNING: 40% of the calibration pairs")
    listed = {j["id"]: j for j in _get(demo_service, "/v1/jobs").json()["items"]}
    assert listed[job]["warnings"] is None  # lists do not read outputs


def test_a_damaged_table_leaves_the_warnings_unread_and_the_job_answered(demo_service, caplog) -> None:
    """Metadata that is not JSON: the job is still answered (its store row is the record),
    ``warnings`` is null and the log says why in one line."""
    import logging

    import pyarrow.parquet as pq

    from pairclean import schema

    job = _finished_unread(demo_service, "damaged")
    (path,) = sorted((demo_service.root / "damaged" / "out").glob("*.parquet"))
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({schema.META_KEY: b"{not json"}), path)
    with caplog.at_level(logging.WARNING, logger="pairclean_service.routers.jobs"):
        r = _get(demo_service, f"/v1/jobs/{job}")
    assert r.status_code == 200 and r.json()["state"] == "SUCCEEDED" and r.json()["warnings"] is None
    assert any(f"job {job}: the output's warnings could not be read" in m for m in caplog.messages)


def test_an_unreadable_table_is_null_at_once_and_never_cached_as_no_warnings(demo_service) -> None:
    """A FIFO planted in place of the table answered no poll (each held a worker for good);
    a table missing for a moment was cached as "no warnings" for the process's life."""
    import os
    import time

    job = _finished_unread(demo_service, "fifo")
    out = demo_service.root / "fifo" / "out"
    (path,) = sorted(out.glob("*.parquet"))
    _plant_junk_fit(out, share=0.4)
    kept = path.with_name("kept.bin")
    path.rename(kept)
    os.mkfifo(path)
    started = time.monotonic()
    r = _get(demo_service, f"/v1/jobs/{job}")
    assert r.status_code == 200 and r.json()["warnings"] is None and time.monotonic() - started < 30
    path.unlink()
    assert _get(demo_service, f"/v1/jobs/{job}").json()["warnings"] is None  # missing: not read, not "nothing"
    kept.rename(path)
    from pairclean.output.report import junk_warning

    assert _get(demo_service, f"/v1/jobs/{job}").json()["warnings"] == [junk_warning(0.4)]  # read once it is back


def test_metadata_of_the_wrong_shape_is_null_not_a_500(demo_service) -> None:
    """A list in place of the metadata object (AttributeError) or a huge integer in the fit
    (OverflowError) made GET /v1/jobs/{id} a 500."""
    import pyarrow.parquet as pq

    from pairclean import schema

    for name, meta in (("listmeta", b"[1, 2]"), ("hugeint", json.dumps({"p_clean": {"fit": {
            "pi_random": 10**400, "random_level": {"threshold": 0.1, "quantile": 0.75, "share": 0.4}}}}).encode())):
        job = _finished_unread(demo_service, name)
        (path,) = sorted((demo_service.root / name / "out").glob("*.parquet"))
        table = pq.read_table(path)
        pq.write_table(table.replace_schema_metadata({schema.META_KEY: meta}), path)
        r = _get(demo_service, f"/v1/jobs/{job}")
        assert r.status_code == 200, (name, r.text)
        assert r.json()["warnings"] in (None, []), (name, r.json()["warnings"])
