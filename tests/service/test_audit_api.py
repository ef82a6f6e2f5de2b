"""The audit loop's JSON API over real HTTP against the real app, on a real scored job
(three copies of the demo shard: 30 pairs, 12 of them swapped captions)."""

from __future__ import annotations

import csv
import io
import re
import time

import httpx
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow
HTTP = httpx.Client(timeout=120)  # a loaded CI machine: the first report imports scikit-learn


@pytest.fixture(scope="module")
def job(demo_service) -> str:
    return demo_service.audit_job("audit-api")


def _h(demo_service, owner: str = "team-a") -> dict[str, str]:
    return {"Authorization": f"Bearer {demo_service.keys[owner]}"}


def _truth(demo_service, key: str) -> str:
    return "noisy" if key in demo_service.swapped else "clean"


def test_label_the_queue_over_http_and_get_the_figures(demo_service, job: str, tmp_path) -> None:
    base, h = f"{demo_service.url}/v1/jobs/{job}/audit", _h(demo_service)
    first = HTTP.get(f"{base}/next", headers=h).json()
    assert first["done"] is False and first["position"] == 0 and first["progress"] == {"labelled": 0, "queue": 30, "labels": 0}
    assert first["caption"] and "p_clean" not in first and "similarity" not in first  # the labeller never sees the model's view
    assert first["summary"] == "no labels yet"
    assert HTTP.get(base, headers=h).json()["status"] == "too_few_labels"

    seen, repeats, keys = [], 0, {}
    while True:
        item = HTTP.get(f"{base}/next", headers=h).json()
        if item["done"]:
            break
        if item["position"] in seen:
            repeats += 1  # a blind repeat: nothing in the reply says so
        seen.append(item["position"])
        keys[item["position"]] = item["key"]
        r = HTTP.post(f"{base}/labels", headers=h,
                       json={"labels": [{"position": item["position"], "key": item["key"], "label": _truth(demo_service, item["key"])}]})
        assert r.status_code == 201, r.text
        assert len(seen) < 100
    assert sorted(set(seen)) == list(range(30)) and repeats >= 2

    # A retried request (or a double click) stores nothing more and counts as no repeat;
    # another label of a pair already labelled, unasked, is refused.
    retry = {"labels": [{"position": seen[-1], "key": keys[seen[-1]], "label": _truth(demo_service, keys[seen[-1]])}] * 2}
    r = HTTP.post(f"{base}/labels", headers=h, json=retry)
    assert r.status_code == 201 and r.json() == {"stored": 0, "already_stored": 2}, r.text
    other = "clean" if retry["labels"][0]["label"] == "noisy" else "noisy"
    r = HTTP.post(f"{base}/labels", headers=h, json={"labels": [retry["labels"][0] | {"label": other}]})
    assert r.status_code == 409 and "undo" in r.json()["detail"]

    report = HTTP.get(base, headers=h).json()
    assert report["status"] == "ok"
    assert report["labels"]["decisive_pairs"] == 30 and report["labels"]["conflicting_pairs"] == 0
    assert report["noise_rate"]["estimate"] == pytest.approx(0.4)  # 12 of 30, every pair labelled
    assert report["noisy_flag"]["recall"]["estimate"] == 1.0
    assert report["self_agreement"]["repeats"] == repeats and report["self_agreement"]["agreement"] == 1.0

    # /metrics (no key): counts with bounded labels, never a job's figures nor its id
    text = HTTP.get(f"{demo_service.url}/metrics").text
    assert re.search(r'pairclean_audit_reports_total\{status="ok"\} [1-9]', text)
    assert not [line for line in text.splitlines() if line.startswith("pairclean_audit") and "_total" not in line
                and "_created" not in line]
    assert re.search(r'pairclean_audit_labels_total\{label="noisy"\} \d', text)
    assert job not in text

    # the export is the file `pairclean audit OUT --labels` reads, CSV or Parquet
    exported = HTTP.get(f"{base}/labels", headers=h)
    assert exported.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(exported.text)))
    from pairclean_service.security import hash_key

    # labelled as the owner and the key (the first 8 hex digits of its sha256)
    assert len(rows) == 30 + repeats and {r["who"] for r in rows} == {f"team-a#{hash_key(demo_service.keys['team-a'])[:8]}"}
    assert {r["label"] for r in rows} == {"clean", "noisy"}
    table = pq.read_table(io.BytesIO(HTTP.get(f"{base}/labels?format=parquet", headers=h).content))
    assert table.num_rows == len(rows) and table.column("key").to_pylist() == [r["key"] for r in rows]
    labels = tmp_path / "labels.csv"
    labels.write_text(exported.text)
    from pairclean_workers.cli import main

    out = str(demo_service.root / "audit-api" / "out")
    assert main(["audit", out, "--sample", "400", "--seed", "0", "--out", str(tmp_path / "q.csv")]) == 0
    assert main(["audit", out, "--labels", str(labels)]) == 0  # the service's queue is the CLI's with the same seed
    assert pq.read_table(f"{out}/copy-000000.parquet").column_names.count("p_clean_model") == 1
    # Every reader agrees on the audited tables: the job's noise-rate estimate (stored when it
    # ended, from the model's p_clean) becomes 1 - mean of the audited p_clean, in the job,
    # the job list and the page; the page's flag rule names the audit.
    import pyarrow.dataset as pads

    tables = pads.dataset(out, format="parquet").to_table(columns=["status", "p_clean"]).to_pylist()
    audited = 1 - sum(r["p_clean"] for r in tables if r["status"] == "ok") / sum(r["status"] == "ok" for r in tables)
    assert HTTP.get(f"{demo_service.url}/v1/jobs/{job}", headers=h).json()["noise_rate_estimate"] == pytest.approx(audited, abs=1e-6)
    listed = HTTP.get(f"{demo_service.url}/v1/jobs", headers=h).json()["items"]
    assert next(j for j in listed if j["id"] == job)["noise_rate_estimate"] == pytest.approx(audited, abs=1e-6)
    with httpx.Client(base_url=demo_service.url, timeout=120) as client:
        client.post("/ui/login", data={"api_key": demo_service.keys["team-a"], "next": "/ui/jobs"})
        page = client.get(f"/ui/jobs/{job}").text
    assert f"{100 * audited:.1f}%" in page and "recalibrated by an audit on" in page

    # undo removes the caller's latest label
    last = HTTP.post(f"{base}/labels:undo", headers=h).json()["removed"]
    assert last is not None and last["key"] == rows[-1]["key"]


def test_another_tenant_sees_nothing(demo_service, job: str) -> None:
    base, h = f"{demo_service.url}/v1/jobs/{job}/audit", _h(demo_service, "team-b")
    for method, path, body in [("GET", "", None), ("GET", "/next", None), ("GET", "/labels", None),
                               ("POST", "/labels", {"labels": [{"position": 0, "key": "x", "label": "clean"}]}),
                               ("POST", "/labels:undo", None)]:
        r = HTTP.request(method, f"{base}{path}", headers=h, json=body)
        assert r.status_code == 404, (path, r.text)
    assert HTTP.get(f"{base}/next").status_code == 401


def test_labels_are_an_enum_of_queued_pairs_and_bounded(demo_service, job: str) -> None:
    base, h = f"{demo_service.url}/v1/jobs/{job}/audit", _h(demo_service)
    item = HTTP.get(f"{base}/next", headers=h).json()
    key = item.get("key") or HTTP.get(f"{base}/labels", headers=h).text.splitlines()[1].split(",")[0]
    bad = HTTP.post(f"{base}/labels", headers=h, json={"labels": [{"position": 0, "key": key, "label": "<script>probably"}]})
    assert bad.status_code == 422 and "<script>" not in bad.text
    assert HTTP.post(f"{base}/labels", headers=h, json={"labels": [{"position": 0, "key": "not-queued", "label": "clean"}]}).status_code == 422
    assert HTTP.post(f"{base}/labels", headers=h, json={"labels": [{"position": 10_000, "key": key, "label": "clean"}]}).status_code == 422
    many = {"labels": [{"position": 0, "key": key, "label": "clean"}] * 501}
    assert HTTP.post(f"{base}/labels", headers=h, json=many).status_code == 422
    assert HTTP.get(f"{base}/labels?format=xlsx", headers=h).status_code == 422


def test_page_posts_are_csrf_safe(demo_service, job: str) -> None:
    with httpx.Client(base_url=demo_service.url, timeout=120) as client:
        r = client.post("/ui/login", data={"api_key": demo_service.keys["team-a"], "next": "/ui/jobs"})
        assert r.status_code == 303
        url = f"/ui/jobs/{job}/audit/labels.json"
        body = '{"position": 0, "key": "x", "label": "clean"}'
        evil = client.post(url, content=body, headers={"Content-Type": "application/json", "Origin": "https://evil.example"})
        assert evil.status_code == 403
        form = client.post(url, content="position=0", headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert form.status_code == 415
        page = client.get(f"/ui/jobs/{job}/audit")
        assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
        assert "<script src=\"/ui/static/audit.js\">" in page.text


def test_labels_sent_at_once_are_stored_once_and_undos_remove_one_each(demo_service) -> None:
    """Round 6: "already labelled?" and the insert ran apart, so 24 copies of one request sent
    at once were all stored (and counted as blind repeats agreeing with themselves); undos sent
    at once reported one label removed twice. A 100 kB ``[[[...`` body got the page's POSTs a
    500 and a traceback in the log; a key over 1,024 characters was queued but could never be
    labelled (422), so the page served that pair for ever."""
    from concurrent.futures import ThreadPoolExecutor

    job = demo_service.audit_job("audit-races")
    base, h = f"{demo_service.url}/v1/jobs/{job}/audit", _h(demo_service)
    item = HTTP.get(f"{base}/next", headers=h).json()
    body = {"labels": [{"position": item["position"], "key": item["key"], "label": "clean"}]}
    with ThreadPoolExecutor(24) as pool:
        replies = list(pool.map(lambda _: HTTP.post(f"{base}/labels", headers=h, json=body), range(24)))
    assert all(r.status_code == 201 for r in replies), [r.text for r in replies]
    assert sum(r.json()["stored"] for r in replies) == 1
    assert HTTP.get(f"{base}/next", headers=h).json()["progress"]["labels"] == 1
    for _ in range(3):
        nxt = HTTP.get(f"{base}/next", headers=h).json()
        HTTP.post(f"{base}/labels", headers=h, json={"labels": [{"position": nxt["position"], "key": nxt["key"], "label": "noisy"}]})
    with ThreadPoolExecutor(6) as pool:
        undone = [r.json()["removed"] for r in pool.map(lambda _: HTTP.post(f"{base}/labels:undo", headers=h), range(6))]
    ids = [u["id"] for u in undone if u is not None]
    assert len(ids) == 4 and len(set(ids)) == 4 and undone.count(None) == 2, undone
    long_key = {"labels": [{"position": 0, "key": "k" * 5000, "label": "clean"}]}
    r = HTTP.post(f"{base}/labels", headers=h, json=long_key)
    assert r.status_code == 422 and "no such pair" in r.text  # a key of any length a shard may hold is read
    with httpx.Client(base_url=demo_service.url, timeout=120) as client:
        assert client.post("/ui/login", data={"api_key": demo_service.keys["team-a"], "next": "/ui/jobs"}).status_code == 303
        for url in (f"/ui/jobs/{job}/audit/labels.json", f"/ui/jobs/{job}/audit/undo.json"):
            r = client.post(url, content="[" * 100_000, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["detail"] == "unreadable JSON"


def test_two_keys_of_one_owner_are_two_labellers(demo_service) -> None:
    """Labels were stored under the key's owner name: a team's two members (two keys of one
    owner) were one labeller, so the second's disagreeing label was refused ("you labelled
    this pair already"), a disagreement counted as self-disagreement, and one member's undo
    removed the other's label."""
    from pairclean_service.security import hash_key, new_api_key

    second = new_api_key()
    demo_service.live.app.state.store.add_key(hash_key(second), "team-a")
    job = demo_service.audit_job("audit-two-keys")
    base, one, two = f"{demo_service.url}/v1/jobs/{job}/audit", _h(demo_service), {"Authorization": f"Bearer {second}"}
    item = HTTP.get(f"{base}/next", headers=one).json()
    pair = {"position": item["position"], "key": item["key"]}
    assert HTTP.post(f"{base}/labels", headers=one, json={"labels": [pair | {"label": "clean"}]}).status_code == 201
    r = HTTP.post(f"{base}/labels", headers=two, json={"labels": [pair | {"label": "noisy"}]})
    assert r.status_code == 201 and r.json() == {"stored": 1, "already_stored": 0}, r.text
    report = HTTP.get(base, headers=one).json()
    assert report["labels"]["conflicting_pairs"] == 1 and report["self_agreement"]["repeats"] == 0
    removed = HTTP.post(f"{base}/labels:undo", headers=two).json()["removed"]
    assert removed["label"] == "noisy"  # the second member's own label, not the first's
    rows = list(csv.DictReader(io.StringIO(HTTP.get(f"{base}/labels", headers=one).text)))
    assert [(r["label"], r["who"]) for r in rows] == [("clean", f"team-a#{hash_key(demo_service.keys['team-a'])[:8]}")]
    # labels stored before labellers were keys (who = the owner) stay the owner's keys' own:
    # after an upgrade, undo found none of them and a repeat of such a pair was a second labeller
    store = demo_service.live.app.state.store
    other = HTTP.get(f"{base}/next", headers=one).json()
    store.add_labels(job, "team-a", "team-a", [(other["position"], other["key"], "noisy", 0)])
    assert HTTP.post(f"{base}/labels:undo", headers=two).json()["removed"]["position"] == other["position"]
    # to the microsecond: a blind repeat stored within the second of the first label is another row
    store.add_labels(job, "team-a", "x#1", [(other["position"], other["key"], "noisy", 0)])
    store.add_labels(job, "team-a", "x#1", [(other["position"], other["key"], "noisy", 1)])
    stamps = [lab["labelled_at"] for lab in store.audit_labels(job, "team-a") if lab["who"] == "x#1"]
    assert len(stamps) == 2 and stamps[0] != stamps[1] and len(stamps[0]) == 32


def test_a_retry_that_commits_more_shards_is_named_and_labels_wait_for_its_end(demo_service, tmp_path) -> None:
    """The queue is drawn once, from the shards committed then: after a ``:retry`` committed
    more, the figures silently described the first shards only, and labels were taken while
    the retried job ran."""
    import shutil

    folder = demo_service.root / "audit-retry"
    folder.mkdir()
    good = shutil.copy(demo_service.shard, folder / "copy-000000.tar")
    broken = folder / "copy-000001.tar"
    broken.write_bytes(b"not a tar at all" * 100)
    job = demo_service.submit([str(good), str(broken)], str(folder / "out"))
    base, h = f"{demo_service.url}/v1/jobs/{job}/audit", _h(demo_service)

    def ended() -> str:
        for _ in range(1200):
            state = str(HTTP.get(f"{demo_service.url}/v1/jobs/{job}", headers=h).json()["state"])
            if state not in ("QUEUED", "RUNNING"):
                return state
            time.sleep(0.25)
        raise AssertionError("the job did not end")

    assert ended() in ("PARTIAL", "FAILED")  # one shard of two committed
    item = HTTP.get(f"{base}/next", headers=h).json()
    assert item["warning"] is None and item["progress"]["queue"] == 10
    shutil.copy(demo_service.shard, broken)  # the bad shard fixed, then the job retried
    assert HTTP.post(f"{demo_service.url}/v1/jobs/{job}:retry", headers=h).status_code == 200
    r = HTTP.post(f"{base}/labels", headers=h, json={"labels": [{"position": item["position"], "key": item["key"], "label": "clean"}]})
    assert r.status_code == 409 and "labels are taken once it has ended" in r.json()["detail"]
    assert ended() == "SUCCEEDED"
    item = HTTP.get(f"{base}/next", headers=h).json()
    assert "drawn when 1 shards were committed; 2 are now" in item["warning"]
    assert "drawn when 1 shards were committed" in HTTP.get(base, headers=h).json()["warning"]
